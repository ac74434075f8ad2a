"""The `plan` subcommand's parser (the simulation loads when the command runs: `--help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Any

from rewardstack._models import DTYPES


def _plan(args: argparse.Namespace) -> int:
    from rewardstack._planning.plan import cmd_plan

    return cmd_plan(args)


def add_parser(sub: Any) -> None:
    """The `plan` subcommand's arguments (cli.py registers it)."""
    p = sub.add_parser("plan", help="will this stack fit a card of this size? (configs only, no weights, no GPU)")
    p.add_argument("--config", default=None, help="stack config (default: the shipped default stack)")
    p.add_argument("--device-memory", default=None,
                   help="the card's memory, e.g. 24GiB, 40GiB, 80GiB (default: the config's [memory] device_memory)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="run every model in this dtype")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    p.add_argument("--no-cache", action="store_true",
                   help="simulate everything again (default: reuse $REWARDSTACK_HOME/plan-cache, shared by every config, keyed by the code and versions)")
    p.set_defaults(func=_plan)
