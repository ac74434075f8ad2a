"""Loads checkpoints through transformers' own `from_pretrained`, once per (path, class, dtype).

A checkpoint that two scorers name (all-mpnet-base-v2 for relevance and diversity) is loaded once
and shared. Paths are hub ids or local folders; loading never unpickles (`use_safetensors` is
preferred and `weights_only` loading is what transformers does for .bin files).

Place, then load onto the card: models load on the host (transformers builds them on the meta
device and reads safetensors through a memory map, so no second copy of the weights is made) and
are not moved to the device here. Placement (`rewardstack._memory.placement`) decides from the
weights' exact sizes which models stay resident and moves only those to the card, so a stack that
does not fit the card cannot run out of memory while loading. Dahoas's plain state-dict file (`.pt`)
is read the same way (`scorers.dahoas.load_dahoas`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from rewardstack.errors import ModelLoadError

log = logging.getLogger("rewardstack.loading")

# The configured dtype, as configured on every device (torch's CPU kernels run float16: a float16
# model's numbers, e.g. DPO's saturating penalty, are the same on CPU as on a GPU).
DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelCache:
    """Shared, lazily loaded models and tokenizers, keyed by what was loaded and how."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._models: dict[tuple, torch.nn.Module] = {}
        self._tokenizers: dict[tuple, Any] = {}
        self._adopted: dict[tuple[str, str, str], torch.nn.Module] = {}

    def tokenizer(self, path: str, *, revision: str | None = None, **kwargs: Any) -> Any:
        """An AutoTokenizer for `path`, loaded once."""
        key = (path, revision, tuple(sorted(kwargs.items())))
        if key not in self._tokenizers:
            from transformers import AutoTokenizer

            try:
                self._tokenizers[key] = AutoTokenizer.from_pretrained(path, revision=revision, **kwargs)
            except Exception as e:  # noqa: BLE001 - transformers raises many types here
                raise ModelLoadError(f"cannot load tokenizer from {path!r}: {e}") from e
        return self._tokenizers[key]

    def model(
        self,
        path: str,
        loader: Callable[..., torch.nn.Module] | type,
        *,
        dtype: str = "float32",
        revision: str | None = None,
        **kwargs: Any,
    ) -> torch.nn.Module:
        """`loader.from_pretrained(path)` in eval mode on the host, loaded once and shared.

        The model is not moved to the device: placement moves the models that stay resident.
        """
        name = loader.__name__
        if (path, name, dtype) in self._adopted:
            return self._adopted[(path, name, dtype)]
        key = (path, name, dtype, revision, tuple(sorted(kwargs.items())))
        if key not in self._models:
            try:
                model = loader.from_pretrained(path, dtype=DTYPE_BY_NAME[dtype], revision=revision, **kwargs)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"cannot load {name} from {path!r}: {e}") from e
            model.eval()
            model.requires_grad_(False)
            self._models[key] = model
            log.info("loaded %s from %s (%s) on the host; placement moves it to %s if resident", name, path, dtype, self.device)
        return self._models[key]

    def adopt(self, path: str, loader: Callable[..., torch.nn.Module] | type, model: torch.nn.Module, *,
              dtype: str = "float32") -> None:
        """Serve `model`, built in this process, wherever `loader` would load `path` in `dtype` (the
        folder then needs its config and tokenizer only): scripts/gpu_card.py serves an 8B model
        built on the card with random weights, which writing and reading back would not fit a
        lease. Placement moves it as any loaded model."""
        self._adopted[(path, loader.__name__, dtype)] = model.eval().requires_grad_(False)

    def pretrained(self, path: str, loader: Callable[..., torch.nn.Module] | type, *, dtype: str = "float32",
                   revision: str | None = None, tokenizer_options: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> tuple[Any, torch.nn.Module]:
        """The (tokenizer, model) pair of one checkpoint, both loaded once and shared.

        `kwargs` go to both `from_pretrained` calls (`trust_remote_code` from `hub.load_source`);
        `tokenizer_options` (a table's `truncation_side`) to the tokenizer's alone. They are part of
        its key, so scorers share a tokenizer only when they want it set alike: a scorer never sets
        anything on a tokenizer another scorer uses (two tables on one folder keep their own sides).
        """
        return (self.tokenizer(path, revision=revision, **kwargs, **(tokenizer_options or {})),
                self.model(path, loader, dtype=dtype, revision=revision, **kwargs))
