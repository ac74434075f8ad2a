"""Helpers the memory tests share that the product has no use for."""

from __future__ import annotations

from rewardstack._memory.costmodel import CostModel


def scale(cost: CostModel, factor: float) -> CostModel:
    """Multiply every coefficient of `cost` (and its prefix rate and lone fit): a model under-fitted
    on purpose, whose planned batches then run out of memory."""
    cost.a, cost.b, cost.c, cost.d, cost.e, cost.f, cost.g, cost.h = (v * factor for v in cost.coefficients())
    if cost.alt is not None:
        cost.alt = [v * factor for v in cost.alt]
    if cost.prefix_rate is not None:
        cost.prefix_rate *= factor
    if cost.lone is not None:
        scale(cost.lone, factor)
    return cost
