"""CUDA caching-allocator settings: expandable segments at start, empty the cache only when fragmented.

`configure_allocator()` must run before the first CUDA call of the process (PyTorch reads
PYTORCH_CUDA_ALLOC_CONF once, when CUDA initializes); the stack calls it before loading any model.
A user's own PYTORCH_CUDA_ALLOC_CONF is always left alone.

`maybe_empty_cache()` returns cached blocks to the driver only when measured fragmentation (reserved
minus allocated bytes, and the inactive split blocks the allocator cannot reuse for big requests)
crosses a threshold: emptying every step costs a device sync and cudaFree/cudaMalloc churn.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

log = logging.getLogger("rewardstack.memory")

ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_CONF = "expandable_segments:True"


def configure_allocator(environ: dict[str, str] | None = None) -> str | None:
    """Set expandable segments unless the user chose allocator settings; return the setting in force.

    Warns (and changes nothing) if CUDA is already initialized, since the setting would be ignored.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV):
        log.info("allocator: keeping the user's %s=%s", ENV, env[ENV])
        return env[ENV]
    if torch.cuda.is_initialized():
        log.warning(
            "allocator: CUDA is already initialized, %s=%s would be ignored; call configure_allocator() "
            "before the first CUDA call", ENV, DEFAULT_CONF,
        )
        return None
    env[ENV] = DEFAULT_CONF
    log.info("allocator: %s=%s", ENV, DEFAULT_CONF)
    return DEFAULT_CONF


@dataclass
class CacheDecision:
    """What `maybe_empty_cache` measured and did (bytes)."""

    emptied: bool
    reserved: int = 0
    allocated: int = 0
    inactive_split: int = 0
    reason: str = ""

    @property
    def fragmentation(self) -> int:
        """Reserved bytes not holding a live tensor."""
        return self.reserved - self.allocated


def _cuda_stats(device: torch.device) -> Mapping[str, int]:  # pragma: no cover - CUDA-only path
    return torch.cuda.memory_stats(device)


def _cuda_empty(device: torch.device) -> None:  # pragma: no cover - CUDA-only path
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


def maybe_empty_cache(
    device: torch.device | str,
    threshold: int = 1024**3,
    *,
    split_threshold: int | None = None,
    stats: Callable[[torch.device], Mapping[str, int]] | None = None,
    empty: Callable[[torch.device], None] | None = None,
) -> CacheDecision:
    """Empty the CUDA cache only if reserved-allocated > `threshold` or inactive split bytes > `split_threshold`.

    `split_threshold` defaults to half of `threshold`. `stats`/`empty` replace the CUDA calls (tests).
    On a non-CUDA device without injected stats nothing is done.
    """
    dev = torch.device(device)
    if dev.type != "cuda" and stats is None:
        return CacheDecision(False, reason="not a CUDA device")
    s = (stats or _cuda_stats)(dev)
    reserved = int(s.get("reserved_bytes.all.current", 0))
    allocated = int(s.get("allocated_bytes.all.current", 0))
    inactive = int(s.get("inactive_split_bytes.all.current", 0))
    split_limit = threshold // 2 if split_threshold is None else split_threshold
    d = CacheDecision(False, reserved, allocated, inactive)
    if reserved - allocated > threshold:
        d.reason = f"reserved-allocated {reserved - allocated} > {threshold}"
    elif inactive > split_limit:
        d.reason = f"inactive split {inactive} > {split_limit}"
    else:
        d.reason = "below thresholds"
        return d
    (empty or _cuda_empty)(dev)
    d.emptied = True
    log.info("allocator: emptied the cache (%s)", d.reason)
    return d
