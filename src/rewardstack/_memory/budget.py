"""The budget: how many bytes the forward passes may use, and the card it is sized on.

On CUDA (like vLLM's gpu_memory_utilization): the card's size (the real one, or `[memory]
device_memory` when set) x `gpu_utilization`, never more than was free when the process started
(another process's memory is not ours), minus the weights resident (when they do not all fit,
placement gets 1 - ACTIVATION_SHARE of it and the passes the rest), minus the memory this process
holds outside torch's allocator (measured, as vLLM does: device memory used now minus used at
start minus what torch reserved since: CUDA context growth, cuBLAS workspaces), minus
`headroom_bytes`; or exactly `memory_budget` bytes when the config sets it. On CPU there is no
device to measure: the budget is `memory_budget` when set (the tensor-bytes tracker then enforces
it as a simulated device) and None (unlimited) otherwise.

`Card` owns the device's readings (the snapshot taken at start, the memory outside torch) and
resolves the `Budget` and the weights' share that placement fills (`MemoryManager.setup`);
`usable_bytes` and `split_card` are the rules it applies, which `rewardstack plan` applies too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from rewardstack.config import StackConfig
from rewardstack._memory.device import MemorySnapshot, allocated_bytes, cuda_snapshot

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
    that `Card.resolve` and `rewardstack plan` read.
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


class Card:
    """The device's memory as the manager reads it: at start and now, on CUDA or on a simulated
    card (`read`, injected by tests), and the bytes this process holds outside torch.

    Without `read` and off CUDA there is no card to read: `startup` is None and every reading
    that needs one is 0.
    """

    def __init__(self, device: torch.device, read: Callable[[torch.device], MemorySnapshot] | None = None) -> None:
        self.device = device
        self.injected = read is not None
        """A simulated card (tests): weights are accounted, never moved, and the allocator is not capped."""
        self._read = read or cuda_snapshot
        self.startup: MemorySnapshot | None = None
        """The device as it was before any model loaded (None: no card to read)."""
        if self.injected or device.type == "cuda":
            self.startup = self.snapshot()
            log.info("device at start: %s", self.startup.describe())
        self.non_torch_bytes = 0
        """Bytes used outside torch's allocator, as last measured (`measure_non_torch`)."""

    def snapshot(self) -> MemorySnapshot:
        """The device's memory now (CUDA, or the injected simulated card of tests): a CUDA snapshot
        has every figure the budget's arithmetic uses (`device_total`, `device_free`, `reserved`,
        `allocated`)."""
        return self._read(self.device)

    def measure_non_torch(self) -> int:
        """Bytes used on the device since start outside torch's allocator (vLLM's "used by the process
        minus reserved"): CUDA context growth, cuBLAS/cuDNN workspaces. 0 without a device."""
        if self.startup is None:
            return 0
        now, start = self.snapshot(), self.startup
        grown = (now.device_total - now.device_free) - (start.device_total - start.device_free)  # type: ignore[operator]
        self.non_torch_bytes = max(0, grown - (now.reserved - start.reserved))  # type: ignore[operator]
        return self.non_torch_bytes

    def allocated_since_start(self, resident: int) -> int:
        """Bytes torch's allocator holds now beyond the `resident` weights and what it held at start
        (the live activation bytes on a card; 0 without one)."""
        if self.startup is None:
            return 0
        allocated = self.snapshot().allocated if self.injected else allocated_bytes(self.device)[0]
        return max(0, allocated - resident - self.startup.allocated)  # type: ignore[operator]

    def size(self, cfg: StackConfig) -> int | None:
        """The size of the card the stack behaves as on: `[memory] device_memory` when set (never
        more than the real card), else the real card; on CPU `device_memory` sizes the simulated
        device, and without it there is none (None)."""
        dm = cfg.memory.device_memory
        if self.startup is None:
            return int(dm) if dm else None
        total = int(self.startup.device_total)  # type: ignore[arg-type]
        return min(total, int(dm)) if dm else total

    def resolve(self, cfg: StackConfig, weights: int) -> tuple[Budget, int | None]:
        """(the budget, the weights' device budget for placement; None: all resident) for a config
        and `weights` bytes of stack weights.

        With a card (CUDA, `[memory] device_memory`, or a simulated card in tests): usable = card x
        gpu_utilization - headroom, on CUDA also at most what was free at start, minus memory
        measured outside torch. If the weights fit in usable minus an activation share, all are
        resident and activations get the rest (or `memory_budget`); otherwise weights get
        (1 - ACTIVATION_SHARE) of usable. On CUDA with `device_memory` the allocator is also
        capped there (`set_per_process_memory_fraction`). CPU without `device_memory`:
        `memory_budget` is both the activation budget and the size of the simulated device the
        weights are placed into; None: unlimited.
        """
        card = self.size(cfg)
        if card is None:
            source = "config" if cfg.memory_budget is not None else "unlimited"
            act = int(cfg.memory_budget) if cfg.memory_budget is not None else None
            return Budget(str(self.device), act, source, weights_bytes=weights), cfg.memory_budget
        free_at_start = None
        outside = 0
        if self.startup is not None:
            # Another process's memory is not ours: never plan past what was free at start.
            free_at_start = self.startup.device_free + self.startup.reserved  # type: ignore[operator]
            outside = self.measure_non_torch()
            if cfg.memory.device_memory and self.device.type == "cuda" and not self.injected:  # pragma: no cover - CUDA-only path
                # A hard cap, so the allocator fails where that card would.
                fraction = min(1.0, card / self.startup.device_total)  # type: ignore[operator]
                torch.cuda.set_per_process_memory_fraction(fraction, self.device)
                log.info("allocator capped at %.3f of the card (device_memory %d bytes)", fraction, card)
        usable = usable_bytes(card, cfg, free_at_start=free_at_start, outside_torch=outside)
        weights_budget, act = split_card(usable, weights, cfg.memory_budget)
        budget = Budget(str(self.device), int(act), "config" if cfg.memory_budget is not None else "device",
                        card, cfg.gpu_utilization, weights, cfg.headroom_bytes, free_at_start, self.non_torch_bytes)
        return budget, weights_budget

    def charge_growth(self, budget: Budget) -> bool:
        """Take the memory that appeared outside torch since `budget` was resolved off its activation
        bytes (cuBLAS workspaces appear at the first matmul, during profiling); a budget the config
        set stays as set. True when the budget changed; without a card, or unlimited, nothing is read."""
        if self.startup is None or budget.activation_bytes is None:
            return False
        grown = self.measure_non_torch() - budget.non_torch_bytes
        if grown <= 0 or budget.source == "config":
            return False
        budget.non_torch_bytes = self.non_torch_bytes
        budget.activation_bytes = max(0, budget.activation_bytes - grown)
        log.info("memory outside torch grew by %d bytes while profiling: %s", grown, budget.describe())
        return True

