"""Sizing the card: the memory manager's budget setup (`MemoryManager.setup`) and live-byte accounting.

A mixin of `MemoryManager` (`rewardstack.memory.manager`), kept apart along its seam: how big the
card is, what is usable, what the weights and activations get, and what is live now.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from rewardstack.memory.budget import (
    ACTIVATION_SHARE,
    Budget,
    DeviceSnapshot,
    compute_budget,
    cuda_allocated,
    cuda_snapshot,
    cuda_total_memory,
    split_card,
    usable_bytes,
    weights_bytes,
)

log = logging.getLogger("rewardstack.memory")


class CardSizing:
    """`MemoryManager`'s budget setup and live-byte accounting (state lives on the manager)."""

    def snapshot(self) -> DeviceSnapshot:
        """The device's memory now (CUDA, or the injected simulated card of tests)."""
        return (self._snapshot or cuda_snapshot)(self.device)

    def measure_non_torch(self) -> int:
        """Bytes used on the device since start outside torch's allocator (vLLM's "used by the process
        minus reserved"): CUDA context growth, cuBLAS/cuDNN workspaces. 0 without a device."""
        if self.startup is None:
            return 0
        now = self.snapshot()
        grown = (now.total - now.free) - (self.startup.total - self.startup.free)
        self.non_torch_bytes = max(0, grown - (now.reserved - self.startup.reserved))
        return self.non_torch_bytes

    def live_bytes(self) -> int:
        """Activation bytes live on the device now, the same quantity on every device.

        Simulated device: the tracker's count. CUDA: allocated bytes minus the resident weights
        (and minus what was allocated before the stack started). Planning subtracts this from the
        budget, so a prefix cache or another model's kept tensors are never counted as free.
        """
        if self.tracker is not None:
            return self.tracker.live_bytes
        if self.startup is None:
            return 0
        allocated = self.snapshot().allocated if self._snapshot is not None else cuda_allocated(self.device)
        resident = self.placement.device_bytes() if self.placement is not None else 0
        return max(0, allocated - resident - self.startup.allocated)

    def card_bytes(self, cfg: Any, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """The size of the card the stack behaves as on: `[memory] device_memory` when set (never
        more than the real card), else the real card; on CPU `device_memory` sizes the simulated
        device, and without it there is none (None)."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if total_memory is not None:
            total: int | None = int(total_memory(self.device))
        elif self.startup is not None:
            total = self.startup.total
        elif self.device.type == "cuda":  # pragma: no cover - CUDA-only path
            total = cuda_total_memory(self.device)
        else:
            return int(dm) if dm else None
        return min(total, int(dm)) if dm else total

    def setup(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> Budget:
        """Resolve the budget from a StackConfig and place the registered models.

        With a card (CUDA, `[memory] device_memory`, or `total_memory` in tests): usable = card x
        gpu_utilization - headroom, on CUDA also at most what was free at start, minus memory
        measured outside torch. If the weights fit in usable minus an activation share, all are
        resident and activations get the rest (or `memory_budget`); otherwise weights get
        (1 - ACTIVATION_SHARE) of usable, placed by `Placement`. On CUDA with `device_memory`
        the allocator is also capped there (`set_per_process_memory_fraction`).
        CPU without `device_memory`: `memory_budget` is both the activation budget the tracker
        enforces and the size of the simulated device the weights are placed into; None: unlimited.
        """
        seen: dict[int, torch.nn.Module] = {}
        for mods, _, _ in self._registered.values():
            for m in mods:
                seen[id(m)] = m
        weights = weights_bytes(list(seen.values()))
        card = self.card_bytes(cfg, total_memory)
        if card is not None:
            free_at_start = None
            outside = 0
            if self.startup is not None:
                # Another process's memory is not ours: never plan past what was free at start.
                free_at_start = self.startup.free + self.startup.reserved
                outside = self.measure_non_torch()
                self._cap_allocator(cfg, card)
            usable = usable_bytes(card, cfg, free_at_start=free_at_start, outside_torch=outside)
            weights_budget, act = split_card(usable, weights, cfg.memory_budget)
            budget = Budget(str(self.device), int(act), "config" if cfg.memory_budget is not None else "device",
                            card, cfg.gpu_utilization, weights, cfg.headroom_bytes, free_at_start, self.non_torch_bytes)
        else:
            budget = compute_budget(cfg, self.device, weights)
            weights_budget = cfg.memory_budget
        self.budget = budget
        log.info("memory budget: %s (stack weights %d bytes)", budget.describe(), weights)
        self.set_budget(budget.activation_bytes)
        if self._registered:
            self.place(weights_budget)
        return budget

    def _cap_allocator(self, cfg: Any, card: int) -> None:
        """`[memory] device_memory` on CUDA: a hard cap, so the allocator fails where that card would."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if not dm or self.device.type != "cuda" or self._snapshot is not None:
            return
        fraction = min(1.0, card / self.startup.total)  # type: ignore[union-attr]  # pragma: no cover - CUDA-only path
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)  # pragma: no cover - CUDA-only path
        log.info("allocator capped at %.3f of the card (device_memory %d bytes)", fraction, card)  # pragma: no cover

    def weights_capacity(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """Device bytes the weights may hold when they do not all fit (None: no card to fill).

        The share `setup` gives weights when they do not all fit: usable x (1 - ACTIVATION_SHARE).
        """
        card = self.card_bytes(cfg, total_memory)
        if card is None:
            return None
        return max(0, int(usable_bytes(card, cfg) * (1 - ACTIVATION_SHARE)))
