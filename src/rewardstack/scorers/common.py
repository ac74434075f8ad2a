"""Helpers every decoder scorer shares (DPO, Reciprocate, the judge): the input bound.

`sane_max_length` is the spec's reading of a model's length bound: the config's `max_length`, else
the tokenizer's `model_max_length` where it is a real number (tokenizers without one report 1e30),
else the model config's position limit.
"""

from __future__ import annotations

from typing import Any


def sane_max_length(tokenizer: Any, config: Any, override: int | None) -> int:
    """cfg.max_length, else the tokenizer's model_max_length if sane (<= 1e6), else the config's."""
    if override:
        return int(override)
    m = getattr(tokenizer, "model_max_length", None)
    if m is not None and m <= 1_000_000:
        return int(m)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(config, key, None)
        if v:
            return int(v)
    return 2048
