"""Resolves the activation budget: how many bytes the forward passes of the stack may use.

On CUDA (like vLLM's gpu_memory_utilization): the card's size (the real one, or `[memory]
device_memory` when set) x `gpu_utilization`, never more than was free when the process started
(another process's memory is not ours), minus the weights resident, minus the memory this process
holds outside torch's allocator (measured, as vLLM does: device memory used now minus used at
start minus what torch reserved since: CUDA context growth, cuBLAS workspaces), minus
`headroom_bytes`; or exactly `memory_budget` bytes when the config sets it. On CPU there is no
device to measure: the budget is `memory_budget` when set (the tensor-bytes tracker then enforces
it as a simulated device) and None (unlimited) otherwise. The device's figures are read in
`snapshot` (`MemorySnapshot`, the layer's one snapshot type); this module only does arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from rewardstack.config import StackConfig
from rewardstack._memory.snapshot import cuda_total_memory

log = logging.getLogger("rewardstack.memory")


@dataclass
class Budget:
    """How the activation budget was arrived at (all in bytes; None = not applicable)."""

    device: str
    activation_bytes: int | None
    source: str  # "config" (memory_budget), "device" (measured) or "unlimited"
    total_bytes: int | None = None
    utilization: float | None = None
    weights_bytes: int = 0
    headroom_bytes: int = 0
    free_at_start: int | None = None  # CUDA: free device memory before any model loaded
    non_torch_bytes: int = 0  # CUDA: measured memory outside torch's allocator

    def describe(self) -> str:
        """One line for logs."""
        gib = 1024**3
        if self.activation_bytes is None:
            return f"{self.device}: unlimited activation budget (no memory_budget set on a non-CUDA device)"
        if self.source == "config":
            return f"{self.device}: activation budget {self.activation_bytes / gib:.3f} GiB from memory_budget"
        free = f" (free at start {self.free_at_start / gib:.2f} GiB)" if self.free_at_start is not None else ""
        outside = f" - outside torch {self.non_torch_bytes / gib:.2f} GiB" if self.non_torch_bytes else ""
        return (
            f"{self.device}: activation budget {self.activation_bytes / gib:.3f} GiB = "
            f"{(self.total_bytes or 0) / gib:.2f} GiB total{free} x {self.utilization:.2f} - weights "
            f"{self.weights_bytes / gib:.2f} GiB - headroom {self.headroom_bytes / gib:.2f} GiB{outside}"
        )


def weights_bytes(modules: list[torch.nn.Module] | tuple[torch.nn.Module, ...]) -> int:
    """Bytes of the parameters and buffers of `modules`, each storage counted once.

    The one rule for weight bytes (the budget, placement, the operator log, the simulation): a
    storage shared by several tensors (tied weights, a module in two models) counts once, by its
    data pointer, or by the storage object when it has none (the meta device, where storages have a
    size but no data). A storage that reports no bytes counts its tensor's elements.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            st = t.untyped_storage()
            key = ("ptr", st.data_ptr()) if st.data_ptr() else ("obj", id(st))
            if key in seen:
                continue
            seen.add(key)
            total += int(st.nbytes()) or t.numel() * t.element_size()
    return total


# On a card, when the weights do not all fit, the share of the usable memory kept for activations.
ACTIVATION_SHARE = 0.2


def usable_bytes(card: int, cfg: StackConfig, *, free_at_start: int | None = None, outside_torch: int = 0) -> int:
    """Device bytes the stack may use on a card of `card` bytes, weights and activations together.

    card x `gpu_utilization` - `headroom_bytes` (vLLM's gpu_memory_utilization); on CUDA also
    never more than was free at start (`free_at_start`; another process's memory is not ours) less
    the headroom, and less `outside_torch` (bytes used outside torch's allocator). The one formula
    that `MemoryManager.setup`, `weights_capacity`, `compute_budget` and `rewardstack plan` read.
    """
    usable = int(card * cfg.gpu_utilization) - cfg.headroom_bytes
    if free_at_start is not None:
        usable = min(usable, free_at_start - cfg.headroom_bytes)
    return usable - outside_torch


def split_card(usable: int, weights: int, memory_budget: int | None) -> tuple[int | None, int]:
    """(weights budget, activation bytes) for a card with `usable` bytes and `weights` to hold.

    The one rule `MemoryManager.setup` and `rewardstack plan` share: when the weights fit in
    usable x (1 - ACTIVATION_SHARE), all are resident (weights budget None) and activations get
    the rest; otherwise weights get that share, placed by `Placement`, and activations the other
    ACTIVATION_SHARE. `memory_budget` (the config's) overrides the activation bytes either way.
    """
    if weights <= usable * (1 - ACTIVATION_SHARE):
        weights_budget: int | None = None
        rest = max(0, usable - weights)
    else:
        weights_budget = max(0, int(usable * (1 - ACTIVATION_SHARE)))
        rest = max(0, usable - weights_budget)
    return weights_budget, int(memory_budget) if memory_budget is not None else rest


def compute_budget(
    cfg: StackConfig,
    device: torch.device | str,
    weights: int = 0,
    *,
    total_memory: Callable[[torch.device], int] | None = None,
) -> Budget:
    """The full budget decision; `total_memory` overrides the CUDA query (tests)."""
    dev = torch.device(device)
    if cfg.memory_budget is not None:
        return Budget(str(dev), int(cfg.memory_budget), "config", weights_bytes=weights)
    if dev.type != "cuda" and total_memory is None:
        return Budget(str(dev), None, "unlimited", weights_bytes=weights)
    total = (total_memory or cuda_total_memory)(dev)
    usable = usable_bytes(total, cfg) - weights
    if usable <= 0:
        # The weights alone do not fit: placement must offload; plan activations against what a
        # swapped-in model leaves (logged loudly, the budget is never negative).
        log.warning(
            "weights (%.2f GiB) + headroom exceed %.0f%% of %.2f GiB: activation budget floored at 0",
            weights / 1024**3, cfg.gpu_utilization * 100, total / 1024**3,
        )
        usable = 0
    return Budget(str(dev), usable, "device", total, cfg.gpu_utilization, weights, cfg.headroom_bytes)


def resolve_budget(cfg: StackConfig, device: torch.device | str, weights_bytes: int) -> int | None:
    """The activation budget in bytes for `device` (None = unlimited), and log how it was decided."""
    b = compute_budget(cfg, device, weights_bytes)
    log.info("memory budget: %s", b.describe())
    return b.activation_bytes
