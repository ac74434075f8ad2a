"""The `replay` and `soak` subcommands' parsers (implementations load lazily: `rewardstack --help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Any


def _replay(args: argparse.Namespace) -> int:
    from rewardstack.replay.replay import cmd_replay

    return cmd_replay(args)


def _soak(args: argparse.Namespace) -> int:
    from rewardstack.replay.soak import cmd_soak

    return cmd_soak(args)


def add_parsers(sub: Any) -> None:
    """Register `replay` and `soak` on the CLI's subparsers."""
    r = sub.add_parser("replay", help="score a recorded run from empty state: peaks, reference need, fit, agreement")
    r.add_argument("logs", nargs="+", metavar="LOG",
                   help="completions.log (or its folder with rotated files), a run's parquet file, or step/event JSONL")
    r.add_argument("--config", required=True, help="stack config (TOML)")
    r.add_argument("--budget", help="replay under this memory budget: bytes or a size such as 24GiB (CPU: simulated device)")
    r.add_argument("--run-dir", help="write the run directory (timeline, events, summary.json with the report) here")
    r.add_argument("--steps", help="steps A:B by 0-based position in the log (B excluded; A: and :B work)")
    r.add_argument("--top", type=int, default=3, help="inputs to name behind each model's peak (default 3)")
    r.add_argument("--no-reference", action="store_true", help="skip the full-size simulation of the reference's need")
    r.add_argument("--init-state", action="store_true",
                   help="instead of a report, rebuild normalizers, blacklist and diversity history from the log "
                        "into the config's state_dir (never overwrites a state)")
    r.set_defaults(func=_replay)

    s = sub.add_parser("soak", help="generated traffic with injected OOMs, kills and restarts, compared with a clean run")
    s.add_argument("--config", required=True, help="stack config (TOML)")
    s.add_argument("--steps", type=int, required=True, help="steps to run")
    s.add_argument("--completions", type=int, default=50, help="completions per step (default 50)")
    s.add_argument("--budget", help="memory budget: bytes or a size such as 24GiB (CPU: simulated device)")
    s.add_argument("--faults", type=float, default=0.0, help="share of forward passes that get an injected OOM (0.1 = 10%%)")
    s.add_argument("--kills", type=int, default=0, help="times the supervisor SIGKILLs the scoring process and restarts it")
    s.add_argument("--run-dir", help="folder for the soak's files and summary.json (default: a new folder under ./soak-runs)")
    s.add_argument("--seed", type=int, default=0, help="seed of the workload, the faults and the kill moments")
    s.add_argument("--pathological", action="store_true", help="mix pathological inputs into the steps (rewardstack.replay.pathological)")
    s.add_argument("--max-slope", type=float, default=1024.0, help="memory-at-rest growth, bytes per step, above which the soak fails")
    s.set_defaults(func=_soak)
