"""The card the memory manager sizes its budget on: what the device held at start and holds now.

`Card` owns the device's readings (the snapshot taken at start, the memory this process holds
outside torch's allocator) and resolves the `Budget` from a config and the stack's weight bytes
(`MemoryManager.setup` places the models with the weights' share it returns). The one
usable-memory formula it applies is `budget.usable_bytes`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from rewardstack._memory.budget import ACTIVATION_SHARE, Budget, compute_budget, split_card, usable_bytes
from rewardstack._memory.snapshot import MemorySnapshot, cuda_allocated, cuda_snapshot, cuda_total_memory

log = logging.getLogger("rewardstack.memory")

# The figures of a card reading the budget's arithmetic uses (a CUDA snapshot has them all).
_CARD_FIGURES = ("device_total", "device_free", "reserved", "allocated")


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
        """The device's memory now (CUDA, or the injected simulated card of tests): a reading with
        the four figures the budget's arithmetic uses (`device_total`, `device_free`, `reserved`,
        `allocated`); one that lacks any is refused, never filled with a guess."""
        snap = self._read(self.device)
        missing = [f for f in _CARD_FIGURES if getattr(snap, f) is None]
        if missing:
            raise ValueError(f"a card reading without {', '.join(missing)}: {snap.to_dict()}")
        return snap

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
        allocated = self.snapshot().allocated if self.injected else cuda_allocated(self.device)
        return max(0, allocated - resident - self.startup.allocated)  # type: ignore[operator]

    def size(self, cfg: Any, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """The size of the card the stack behaves as on: `[memory] device_memory` when set (never
        more than the real card), else the real card; on CPU `device_memory` sizes the simulated
        device, and without it there is none (None)."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if total_memory is not None:
            total: int | None = int(total_memory(self.device))
        elif self.startup is not None:
            total = self.startup.device_total
        elif self.device.type == "cuda":  # pragma: no cover - CUDA-only path
            total = cuda_total_memory(self.device)
        else:
            return int(dm) if dm else None
        return min(total, int(dm)) if dm else total

    def resolve(
        self, cfg: Any, weights: int, *, total_memory: Callable[[torch.device], int] | None = None
    ) -> tuple[Budget, int | None]:
        """(the budget, the weights' device budget for placement; None: all resident) for a config
        and `weights` bytes of stack weights.

        With a card (CUDA, `[memory] device_memory`, or `total_memory` in tests): usable = card x
        gpu_utilization - headroom, on CUDA also at most what was free at start, minus memory
        measured outside torch. If the weights fit in usable minus an activation share, all are
        resident and activations get the rest (or `memory_budget`); otherwise weights get
        (1 - ACTIVATION_SHARE) of usable. On CUDA with `device_memory` the allocator is also
        capped there (`set_per_process_memory_fraction`). CPU without `device_memory`:
        `memory_budget` is both the activation budget and the size of the simulated device the
        weights are placed into; None: unlimited.
        """
        card = self.size(cfg, total_memory)
        if card is None:
            return compute_budget(cfg, self.device, weights), cfg.memory_budget
        free_at_start = None
        outside = 0
        if self.startup is not None:
            # Another process's memory is not ours: never plan past what was free at start.
            free_at_start = self.startup.device_free + self.startup.reserved  # type: ignore[operator]
            outside = self.measure_non_torch()
            self._cap_allocator(cfg, card)
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
        before = budget.non_torch_bytes
        grown = self.measure_non_torch() - before
        if grown <= 0 or budget.source == "config":
            return False
        budget.non_torch_bytes = self.non_torch_bytes
        budget.activation_bytes = max(0, budget.activation_bytes - grown)
        log.info("memory outside torch grew by %d bytes while profiling: %s", grown, budget.describe())
        return True

    def weights_capacity(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """Device bytes the weights may hold when they do not all fit (None: no card to fill).

        The share `resolve` gives weights when they do not all fit: usable x (1 - ACTIVATION_SHARE).
        """
        card = self.size(cfg, total_memory)
        if card is None:
            return None
        return max(0, int(usable_bytes(card, cfg) * (1 - ACTIVATION_SHARE)))

    def _cap_allocator(self, cfg: Any, card: int) -> None:
        """`[memory] device_memory` on CUDA: a hard cap, so the allocator fails where that card would."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if not dm or self.device.type != "cuda" or self.injected:
            return
        fraction = min(1.0, card / self.startup.device_total)  # type: ignore[union-attr,operator]  # pragma: no cover - CUDA-only path
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)  # pragma: no cover - CUDA-only path
        log.info("allocator capped at %.3f of the card (device_memory %d bytes)", fraction, card)  # pragma: no cover

