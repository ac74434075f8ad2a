"""The `replay` and `soak` subcommands' parsers (implementations load lazily: `rewardstack --help` stays fast)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Callable

from rewardstack import _paths as paths

DEFAULT_MAX_SLOPE = 1024.0
"""Tracked bytes at rest: growth per step above which the soak fails (docs/REPLAY.md says why)."""
DEFAULT_MAX_RSS_SLOPE = 16 * 1024.0
"""Resident set: growth per step above which the soak fails (docs/REPLAY.md says why)."""


def _lazy(module: str, command: str) -> Callable[[argparse.Namespace], int]:
    """The command `module.command`, imported when it runs."""
    return lambda args: getattr(importlib.import_module(module), command)(args)


def add_parsers(sub: Any) -> None:
    """Register `replay` and `soak` on the CLI's subparsers."""
    r = sub.add_parser("replay", help="score a recorded run from empty state: peaks, reference need, fit, agreement")
    r.add_argument("logs", nargs="+", metavar="LOG",
                   help="completions.log (or its folder with rotated files), a run's parquet file, or step/event JSONL")
    r.add_argument("--config", required=True, help="stack config (TOML)")
    r.add_argument("--budget", help="replay under this memory budget: bytes or a size such as 24GiB (CPU: simulated device)")
    r.add_argument("--run-dir", nargs="?", const=paths.BARE_RUN_DIR, metavar="DIR",
                   help="write the run directory (timeline, events, summary.json with the report) here; bare "
                        "--run-dir: a new folder replay-<time> under $REWARDSTACK_HOME/<config stem>-<hash>/runs")
    r.add_argument("--steps", help="steps A:B by 0-based position in the log (B excluded; A: and :B work)")
    r.add_argument("--top", type=int, default=3, help="inputs to name behind each model's peak (default 3)")
    r.add_argument("--no-reference", action="store_true", help="skip the full-size simulation of the reference's need")
    r.add_argument("--init-state", action="store_true",
                   help="instead of a report, rebuild normalizers, blacklist and diversity history from the log "
                        "into the config's state_dir (never overwrites a state)")
    r.set_defaults(func=_lazy("rewardstack._replay.replay", "cmd_replay"))

    s = sub.add_parser("soak", help="generated traffic with injected OOMs, kills and restarts, compared with a clean run")
    s.add_argument("--config", required=True, help="stack config (TOML)")
    s.add_argument("--steps", type=int, required=True, help="steps to run")
    s.add_argument("--completions", type=int, default=50, help="completions per step (default 50)")
    s.add_argument("--budget", help="memory budget: bytes or a size such as 24GiB (CPU: simulated device)")
    s.add_argument("--faults", type=float, default=0.0, help="share of forward passes that get an injected OOM (0.1 = 10%%)")
    s.add_argument("--kills", type=int, default=0, help="times the supervisor SIGKILLs the scoring process (the server with --service) and restarts it")
    s.add_argument("--run-dir", help="folder for the soak's files and summary.json (default: a new folder soak-<time> under $REWARDSTACK_HOME/<config stem>-<hash>/runs)")
    s.add_argument("--seed", type=int, default=0, help="seed of the workload, the faults and the kill moments")
    s.add_argument("--pathological", action="store_true", help="mix pathological inputs into the steps (rewardstack._replay.pathological)")
    s.add_argument("--max-slope", type=float, default=DEFAULT_MAX_SLOPE,
                   help=f"tracked memory-at-rest growth, bytes per step, above which the soak fails (default {DEFAULT_MAX_SLOPE:g})")
    s.add_argument("--max-rss-slope", type=float, default=DEFAULT_MAX_RSS_SLOPE,
                   help=f"resident-set growth, bytes per step, above which the soak fails (default {DEFAULT_MAX_RSS_SLOPE:g})")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each scoring process (default 1: the faulted "
                                                          "and clean runs run side by side)")
    s.add_argument("--rejudge", metavar="RUN_DIR", help="compare and judge a finished soak's files again (nothing is "
                                                        "scored; --config, --kills and --faults as it ran)")
    s.add_argument("--service", action="store_true", help="soak `rewardstack serve` over loopback instead: clients with "
                                                          "numbered steps and retries, the server SIGKILLed --kills times")
    s.add_argument("--clients", type=int, default=4, help="--service: concurrent clients, one namespace each (default 4)")
    s.add_argument("--timeout", type=float, default=60.0, help="--service: seconds a request may take before the client "
                                                               "retries it (default 60)")
    s.set_defaults(func=_lazy("rewardstack._replay.soak", "cmd_soak"))
