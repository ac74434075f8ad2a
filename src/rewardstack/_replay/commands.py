"""The `replay` subcommand's parser (implementations load lazily: `rewardstack --help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Any

from rewardstack import _paths as paths


def _cmd_replay(args: argparse.Namespace) -> int:
    """`replay`, imported when it runs."""
    from rewardstack._replay.replay import cmd_replay

    return cmd_replay(args)


def add_parsers(sub: Any) -> None:
    """Register `replay` on the CLI's subparsers."""
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
    r.set_defaults(func=_cmd_replay)
