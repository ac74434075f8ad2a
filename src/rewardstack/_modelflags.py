"""The one-line start's flags (`--reward-model` and its table keys), shared by `serve`, `ray-serve` and
`plan`; `config.build_config` turns them into the `[rewards.<name>]` tables a TOML would hold."""

from __future__ import annotations

import argparse
from typing import Any

from rewardstack._argtypes import positive_int
from rewardstack._models import DTYPES


def add_model_flags(parser: argparse.ArgumentParser, *, dtype: bool = True, device: bool = True) -> None:
    """`--reward-model` (repeatable) and the keys every `[rewards.*]` table takes from the command line."""
    parser.add_argument("--reward-model", action="append", default=[], metavar="PATH_OR_HUB_ID",
                        help="serve this HuggingFace reward model (a local folder, or HUB_ID@REVISION) as "
                             "[rewards.<its last path part>]; repeat for several; with --config, added to its tables")
    if dtype:
        parser.add_argument("--dtype", choices=DTYPES, help="weights dtype of every [rewards.*] model (default float32)")
    parser.add_argument("--max-length", type=positive_int,
                        help="length bound in tokens of every [rewards.*] model (default: the tokenizer's)")
    parser.add_argument("--truncation-side", choices=("left", "right"),
                        help="which end of an input past --max-length is cut (default right: keeps the start)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="render `messages` with the tokenizer's chat template (default on)")
    if device:
        parser.add_argument("--device", help="torch device (default: the config's; with no config, cuda where "
                                             "torch finds one, else cpu)")


def model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags' values as `config.build_config`'s keywords (flags a parser lacks: None)."""
    return {"reward_models": list(getattr(args, "reward_model", None) or []),
            "device": getattr(args, "device", None),
            **{k: getattr(args, k, None) for k in ("dtype", "max_length", "truncation_side", "chat_template")}}
