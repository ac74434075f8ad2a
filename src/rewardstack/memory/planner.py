"""Token-budget batching: sort by length, charge each batch its padded rectangle, pack what fits.

As in TEI, a batch costs batch_size x longest_length (padding is paid for), so inputs are sorted by
length first. A batch is closed when adding the next input would push the cost model's predicted
peak past the budget (times a safety margin and the model's trust), or would make a shape the
cost model never measured (`CostModel.admits`: wider, longer or more tokens than its largest
profiled shape). Predictions are only used inside the profiled range, never extrapolated.
"""

from __future__ import annotations

from typing import Sequence

from rewardstack.memory.costmodel import CostModel


def usable_bytes(budget_bytes: float, cost: CostModel, margin: float) -> float:
    """The share of the budget a plan may fill for this cost model."""
    return budget_bytes * margin * cost.trust


def max_fitting_length(cost: CostModel, budget_bytes: float, margin: float, upper: int) -> int:
    """The longest single input (batch of 1) predicted to fit, at most `upper`; 0 if none does.

    Never longer than the longest profiled length: past it the prediction would be a guess.
    """
    limit = usable_bytes(budget_bytes, cost, margin)
    ext = cost.extents()
    if ext is not None:
        upper = min(upper, ext[1])
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost.predict(1, mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_batches(
    lengths: Sequence[int],
    cost: CostModel,
    budget_bytes: float,
    *,
    margin: float = 0.9,
    max_batch: int | None = None,
    largest_first: bool = False,
) -> list[list[int]]:
    """Group input indices into batches whose padded rectangle is predicted to fit the budget.

    Batches hold indices into `lengths`, each batch sorted by ascending length. Callers cut inputs
    to `max_fitting_length` first; an input that still does not fit alone gets a batch of its own
    (the OOM guard then handles it). `largest_first` returns the batch with the largest predicted
    peak first: a wrong prediction fails fast, and the caching allocator reserves its biggest
    block once instead of growing (and fragmenting) step by step.
    """
    limit = usable_bytes(budget_bytes, cost, margin)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(lengths[i], 1)  # ascending order: the newcomer is the longest
        candidate = len(current) + 1
        fits = cost.predict(candidate, longest) <= limit and cost.admits(candidate, longest)
        if current and (not fits or (max_batch is not None and candidate > max_batch)):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    if largest_first:
        batches.sort(key=lambda b: -cost.predict(len(b), max(lengths[b[-1]], 1)))
    return batches
