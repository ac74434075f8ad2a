"""Token-budget batching: sort by length, charge each batch its padded rectangle, pack what fits.

As in TEI, a batch costs batch_size x longest_length (padding is paid for), so inputs are sorted by
length first. A batch is closed when adding the next input would push the cost model's predicted
peak past the budget (times a safety margin and the model's trust), or would make a shape the
cost model never measured (`CostModel.admits`: wider, longer or more tokens than its largest
profiled shape). Predictions are only used inside the profiled range, never extrapolated.

With `slack`, a batch is also closed when its padded rectangle would waste more than that share
of it on padding (`padding_groups`' rule): a scorer that runs each batch in such padding groups
then runs exactly the batch that was planned and predicted, not a smaller rectangle inside it
(charging the whole rectangle would over-predict the calls several times over).
"""

from __future__ import annotations

from typing import Callable, Sequence

from rewardstack._memory.costmodel import CostModel


def plan_limit(budget_bytes: float, cost: CostModel, margin: float) -> float:
    """The share of the budget a plan may fill for this cost model."""
    return budget_bytes * margin * cost.trust


def max_fitting_length(cost: CostModel, budget_bytes: float, margin: float, upper: int) -> int:
    """The longest single input (batch of 1) predicted to fit, at most `upper`; 0 if none does.

    Never longer than the longest profiled length: past it the prediction would be a guess.
    """
    limit = plan_limit(budget_bytes, cost, margin)
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


PADDING_SLACK = 0.25
"""The share of a padded rectangle that may be padding (`padding_groups`, `plan_batches(slack=)`)."""


def wastes_too_much(count: int, longest: int, tokens: int, slack: float) -> bool:
    """Whether `count` inputs of `tokens` real tokens padded to `longest` waste more than `slack`."""
    return count * longest > (1.0 + slack) * tokens


def padding_groups(lengths: Sequence[int], slack: float = PADDING_SLACK) -> list[list[int]]:
    """Split a batch into groups whose padded rectangle wastes at most `slack` of it.

    The planner packs by memory; with a generous budget it may put a 40-token and an 8,000-token
    input together, which pays 8,000 positions for both. Splitting further only lowers memory.
    Returns lists of positions into `lengths`, ascending by length.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return _greedy_groups(order, lengths, lambda count, longest, tokens: wastes_too_much(count, longest, tokens, slack))


def _greedy_groups(order: Sequence[int], lengths: Sequence[int],
                   closes: Callable[[int, int, int], bool]) -> list[list[int]]:
    """Walk `order` (ascending by length) and start a new group wherever `closes(count, longest,
    tokens)` says the current one may not take the next input (count, longest and real tokens
    with it). The one greedy pass both the padding split and the batch planner run."""
    groups: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        n = max(1, lengths[i])  # ascending order: the newcomer is the longest
        if cur and closes(len(cur) + 1, n, tokens + n):
            groups.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        groups.append(cur)
    return groups


def plan_batches(
    lengths: Sequence[int],
    cost: CostModel,
    budget_bytes: float,
    *,
    margin: float = 0.9,
    max_batch: int | None = None,
    largest_first: bool = False,
    slack: float | None = None,
    prefix: int = 0,
) -> list[list[int]]:
    """Group input indices into batches whose padded rectangle is predicted to fit the budget.

    Batches hold indices into `lengths`, each batch sorted by ascending length. Callers cut inputs
    to `max_fitting_length` first; an input that still does not fit alone gets a batch of its own
    (the OOM guard then handles it). `largest_first` returns the batch with the largest predicted
    peak first: a wrong prediction fails fast, and the caching allocator reserves its biggest
    block once instead of growing (and fragmenting) step by step. `slack`: also close a batch
    whose padding would pass that share (see the module docstring). `prefix`: the inputs' shared
    prefix, run before the batches (`CostModel.predict(prefix=)`).
    """
    limit = plan_limit(budget_bytes, cost, margin)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))

    def closes(count: int, longest: int, tokens: int) -> bool:
        fits = cost.predict(count, longest, prefix) <= limit and cost.admits(count, longest)
        padded = slack is not None and wastes_too_much(count, longest, tokens, slack)
        return not fits or padded or (max_batch is not None and count > max_batch)

    batches = _greedy_groups(order, lengths, closes)
    if largest_first:
        batches.sort(key=lambda b: -cost.predict(len(b), max(lengths[b[-1]], 1), prefix))
    return batches
