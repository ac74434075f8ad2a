"""Helpers the scorers share: the input bound of the decoders (DPO, Reciprocate, the judge), and
the padding of token-id rows into one batch tensor (every family).

`sane_max_length` is the spec's reading of a model's length bound: the config's `max_length`, else
the tokenizer's `model_max_length` where it is a real number (tokenizers without one report 1e30),
else the model config's position limit.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


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


def pad_rows(rows: Sequence[Sequence[int]], pad: int, *, left: bool = False,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids padded to one width (right-padded, or left with `left=True`): (ids, mask), long.

    Built as Python lists and converted by one `torch.tensor` call each: filling a preallocated
    tensor row by row costs about five aten ops a row (select, slice, lift_fresh, copy_, detach_),
    which under the tensor-bytes tracker's per-op accounting was half the ops of a tiny soak step.
    """
    w = max(1, max((len(r) for r in rows), default=0)) if width is None else width
    ids, mask = [], []
    for r in rows:
        r = list(r)
        n = w - len(r)
        if left:
            ids.append([pad] * n + r)
            mask.append([0] * n + [1] * len(r))
        else:
            ids.append(r + [pad] * n)
            mask.append([1] * len(r) + [0] * n)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
