"""Loads checkpoints through transformers' own `from_pretrained`, once per (path, class, dtype).

A checkpoint that two scorers name (all-mpnet-base-v2 for relevance and diversity) is loaded once
and shared. Paths are hub ids or local folders; loading never unpickles (`use_safetensors` is
preferred and `weights_only` loading is what transformers does for .bin files).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from rewardstack.errors import ModelLoadError

log = logging.getLogger("rewardstack.loading")

DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """The configured dtype, as configured on every device (torch's CPU kernels run float16: a
    float16 model's numbers, e.g. DPO's saturating penalty, are the same on CPU as on a GPU)."""
    return DTYPE_BY_NAME[name]


class ModelCache:
    """Shared, lazily loaded models and tokenizers, keyed by what was loaded and how."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._models: dict[tuple, torch.nn.Module] = {}
        self._tokenizers: dict[tuple, Any] = {}

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
        """`loader.from_pretrained(path)` in eval mode on the device, loaded once and shared."""
        name = getattr(loader, "__name__", repr(loader))
        key = (path, name, dtype, revision, tuple(sorted(kwargs.items())))
        if key not in self._models:
            from_pretrained = getattr(loader, "from_pretrained", loader)
            try:
                model = from_pretrained(
                    path, dtype=torch_dtype(dtype, self.device), revision=revision, **kwargs
                )
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"cannot load {name} from {path!r}: {e}") from e
            model.eval()
            model.requires_grad_(False)
            self._models[key] = model.to(self.device)
            log.info("loaded %s from %s (%s, %s)", name, path, dtype, self.device)
        return self._models[key]

    def pretrained(self, path: str, loader: Callable[..., torch.nn.Module] | type, *, dtype: str = "float32",
                   revision: str | None = None, **kwargs: Any) -> tuple[Any, torch.nn.Module]:
        """The (tokenizer, model) pair of one checkpoint, both loaded once and shared.

        `kwargs` go to both `from_pretrained` calls (`trust_remote_code` from `hub.load_source`).
        """
        return (self.tokenizer(path, revision=revision, **kwargs),
                self.model(path, loader, dtype=dtype, revision=revision, **kwargs))

    def loaded(self) -> list[torch.nn.Module]:
        """Every distinct model loaded so far."""
        return list(self._models.values())
