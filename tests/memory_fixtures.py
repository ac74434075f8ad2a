"""Helpers the memory tests share that the product has no use for."""

from __future__ import annotations

import torch

from rewardstack._memory.costmodel import CostModel
from rewardstack._memory.device import MemorySnapshot


class FakeCard:
    """A card whose free memory and torch counters the test sets (`MemoryManager(snapshot=)`)."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free, self.reserved, self.allocated = total, free, 0, 0

    def __call__(self, device: torch.device) -> MemorySnapshot:
        return MemorySnapshot(time=0.0, source="cuda", device_total=self.total, device_free=self.free,
                              reserved=self.reserved, allocated=self.allocated)


def scale(cost: CostModel, factor: float) -> CostModel:
    """Multiply every coefficient of `cost` (and its prefix rate and lone fit): a model under-fitted
    on purpose, whose planned batches then run out of memory."""
    cost.a, cost.b, cost.c, cost.d, cost.e, cost.f, cost.g, cost.h = (v * factor for v in cost.coefficients())
    if cost.alt is not None:
        cost.alt = [v * factor for v in cost.alt]
    if cost.prefix_rate is not None:
        cost.prefix_rate *= factor
        cost.prefix_cross *= factor
    if cost.lone is not None:
        scale(cost.lone, factor)
    return cost
