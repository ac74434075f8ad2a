"""Tests of the batch planner: sorting, padded rectangles, the budget, caps and ordering."""

from __future__ import annotations

import random

from rewardstack._memory.costmodel import CostModel, max_fitting_length, plan_batches


def test_every_batch_fits_and_every_input_is_planned_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(200)]
    cost = CostModel(a=100, b=10, c=0.1)
    budget = 200_000
    batches = plan_batches(lengths, cost, budget, margin=0.9)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        rect = cost.predict(len(b), max(lengths[i] for i in b))
        assert rect <= budget * 0.9 or len(b) == 1
        assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)


def test_max_batch_and_trust_shrink_batches() -> None:
    lengths = [10] * 100
    cost = CostModel(b=1.0)
    assert max(len(b) for b in plan_batches(lengths, cost, 1e9, max_batch=16)) == 16
    wide = len(plan_batches(lengths, cost, 1000, margin=1.0))
    cost.distrust(0.5)
    assert len(plan_batches(lengths, cost, 1000, margin=1.0)) > wide


def test_input_too_long_gets_its_own_batch_and_cap_fits() -> None:
    cost = CostModel(c=1.0)
    cap = max_fitting_length(cost, 10_000, 1.0, 10**6)
    assert cost.predict(1, cap) <= 10_000 < cost.predict(1, cap + 1)
    batches = plan_batches([5, 5, 1000], cost, 10_000, margin=1.0)
    assert [2] in batches


def test_largest_first_orders_by_predicted_peak() -> None:
    lengths = [1, 2, 3, 50, 60, 400]
    cost = CostModel(b=1.0)
    batches = plan_batches(lengths, cost, 500, margin=1.0, largest_first=True)
    peaks = [cost.predict(len(b), max(lengths[i] for i in b)) for b in batches]
    assert peaks == sorted(peaks, reverse=True)


def test_length_cap_counts_bytes_already_live_on_the_device() -> None:
    import torch

    from rewardstack._memory import CostModel, MemoryManager

    mm = MemoryManager(1_000_000, margin=1.0)
    mm.set_cost_model("m", CostModel(b=1000.0))  # 1,000 bytes per token
    assert mm.length_cap("m", 10_000) == 1000
    assert mm.tracker is not None
    with mm.tracker:
        held = torch.empty(500_000, dtype=torch.uint8)  # half the device, live
    assert mm.length_cap("m", 10_000) == 500
    del held
    assert mm.length_cap("m", 10_000) == 1000
