"""Loads checkpoints through transformers' own `from_pretrained`, once per (path, class, dtype).

A checkpoint that two scorers name (all-mpnet-base-v2 for relevance and diversity) is loaded once
and shared. Paths are hub ids or local folders; loading never unpickles (`use_safetensors` is
preferred and `weights_only` loading is what transformers does for .bin files).

Place, then load onto the card: models load on the host (transformers builds them on the meta
device and reads safetensors through a memory map, so no second copy of the weights is made) and
are not moved to the device here. Placement (`rewardstack._memory.placement`) decides from the
weights' exact sizes which models stay resident and moves only those to the card, so a stack that
does not fit the card cannot run out of memory while loading. A plain state-dict file (`.pt`) is
read the same way: `load_checkpoint_file` memory-maps it (`torch.load(mmap=True,
weights_only=True)`) and `load_into_empty_model` builds the model with its parameters on the meta
device (accelerate's `init_empty_weights`) and makes the file's tensors its parameters
(`load_state_dict(assign=True)`).
"""

from __future__ import annotations

import logging
from pathlib import Path
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

    def pretrained(self, path: str, loader: Callable[..., torch.nn.Module] | type, *, dtype: str = "float32",
                   revision: str | None = None, **kwargs: Any) -> tuple[Any, torch.nn.Module]:
        """The (tokenizer, model) pair of one checkpoint, both loaded once and shared.

        `kwargs` go to both `from_pretrained` calls (`trust_remote_code` from `hub.load_source`).
        """
        return (self.tokenizer(path, revision=revision, **kwargs),
                self.model(path, loader, dtype=dtype, revision=revision, **kwargs))


def load_checkpoint_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A `.pt`/`.bin` state dict, memory-mapped and tensors only (never unpickles code).

    The tensors stay backed by the file until something writes them: a model that takes them as
    its parameters (`load_into_empty_model`) costs no second copy in host memory.
    """
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # pragma: no cover - legacy (non-zip) files cannot be mapped
        log.info("%s cannot be memory-mapped (legacy format): reading it whole", path)
        return torch.load(str(path), map_location="cpu", weights_only=True)


def load_into_empty_model(
    build: Callable[[], torch.nn.Module],
    state: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    what: str = "checkpoint",
) -> torch.nn.Module:
    """`build()` with its parameters on the meta device, then `state`'s tensors as its parameters.

    Buffers are built normally (small; some are not in checkpoints). Every parameter must come
    from `state`: a missing or unexpected key is a `ModelLoadError`. `dtype` converts the weights
    only where the file holds another dtype.
    """
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = build()
    missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if unexpected or still_meta:
        raise ModelLoadError(f"{what}: missing {sorted(set(missing) | set(still_meta))[:5]}, unexpected {unexpected[:5]}")
    if dtype is not None:
        model.to(dtype)
    return model.eval().requires_grad_(False)
