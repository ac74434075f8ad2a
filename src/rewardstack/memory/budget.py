"""Resolves the activation budget: how many bytes the forward passes of the stack may use.

On CUDA (like vLLM's gpu_memory_utilization): total device memory x `gpu_utilization`, minus the
weights already resident, minus `headroom_bytes` (CUDA context, allocator slack, other processes);
or exactly `memory_budget` bytes when the config sets it. On CPU there is no device to measure: the
budget is `memory_budget` when set (the tensor-bytes tracker then enforces it as a simulated device)
and None (unlimited) otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from rewardstack.config import StackConfig

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

    def describe(self) -> str:
        """One line for logs."""
        gib = 1024**3
        if self.activation_bytes is None:
            return f"{self.device}: unlimited activation budget (no memory_budget set on a non-CUDA device)"
        if self.source == "config":
            return f"{self.device}: activation budget {self.activation_bytes / gib:.3f} GiB from memory_budget"
        return (
            f"{self.device}: activation budget {self.activation_bytes / gib:.3f} GiB = "
            f"{(self.total_bytes or 0) / gib:.2f} GiB total x {self.utilization:.2f} - weights "
            f"{self.weights_bytes / gib:.2f} GiB - headroom {self.headroom_bytes / gib:.2f} GiB"
        )


def weights_bytes(modules: list[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of `modules`, each storage counted once (shared weights)."""
    seen: set[int] = set()
    total = 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            st = t.untyped_storage()
            key = st.data_ptr() if st.data_ptr() else id(t)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
    return total


def cuda_total_memory(device: torch.device) -> int:  # pragma: no cover - CUDA-only path
    _free, total = torch.cuda.mem_get_info(device)
    return int(total)


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
    usable = int(total * cfg.gpu_utilization) - weights - cfg.headroom_bytes
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
