"""The memory layer under the whole stack, on the stand-ins: budgets, injected OOMs, placement.

These are issue-level checks: every scorer runs under a simulated device budget with 100,000-character
completions, OOMs injected at random forward passes never change a score or lose a completion, and a
budget smaller than the stack's weights still scores every step.

A good plan is one whose batches never run out of memory: the tracker raises before its peak could
pass the budget, so "the peak stayed under the budget" is true by construction and proves nothing.
The checks here assert that no planned batch hit a (non-injected) OOM, and the same check with
every cost model deliberately under-fitted is a strict expected failure: it shows they can fail.
"""

from __future__ import annotations

import logging
import math
import random

import pytest

from conftest import standin_config
from rewardstack import RewardStack
from rewardstack.config import ALL_MODELS
from memory_fixtures import scale
from fault_fixtures import CountingInjector
from rewardstack._memory.budget import weights_bytes
from rewardstack._scorers.base import Status
from tests.soak.synthetic import text

MODEL_SCORERS = [n for n in ALL_MODELS if n not in ("blacklist_filter", "task_validator_filter")]


def _steps(seed: int, n_steps: int, n: int, long_chars: int = 0) -> list[dict]:
    rng = random.Random(seed)
    tasks = ["augment", "followup0", "answer0", "followup1", "answer1"]
    steps = []
    for s in range(n_steps):
        base = text(rng, 160)
        comps = [text(rng, rng.choice([0, 3, 20, 80, 200, 600])) for _ in range(n)]
        if long_chars and s == 0:
            comps[1] = text(rng, long_chars)
        steps.append({"name": tasks[s % len(tasks)], "prompt": base + " Ask about it.", "base_prompt": base, "completions": comps})
    return steps


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-4 * max(1.0, abs(b))


def real_ooms(stack: RewardStack) -> list:
    """OOMs of planned batches (injected ones excluded): a sound plan has none."""
    return [r for r in stack.memory.oom_log if not r.injected]


def underfit(stack: RewardStack, factor: float = 0.3) -> None:
    """Shrink every fitted cost model: its plans now pack batches that do not fit."""
    for cost in stack.memory.cost_models.values():
        scale(cost, factor)


BUDGET = 48 * 1024**2


def test_long_completions_are_planned_without_oom_and_fitting_scores_are_unchanged(standins, tmp_path) -> None:  # noqa: ANN001
    budget = BUDGET
    # The 100,000-character input must reach the models (past the default [input] max_chars it
    # would be cut before any of them): this test is of the memory plan for long inputs.
    long_input = {"input": {"max_chars": 200_000}}
    planned = RewardStack(standin_config(standins, tmp_path / "a", memory_budget=budget, **long_input), load_state=False)
    free = RewardStack(standin_config(standins, tmp_path / "b", **long_input), load_state=False)
    assert planned.memory.tracker is not None and planned.memory.budget_bytes == budget
    steps = _steps(1, 1, 6, long_chars=100_000)  # the 100k input beside five that fit
    for step in steps:
        got = planned.score_step(step, save=False)
        want = free.score_step(step, save=False)
        bad = real_ooms(planned)
        assert bad == [], [(r.model, r.batch, r.length) for r in bad]
        for name in MODEL_SCORERS:
            for i, (g, w) in enumerate(zip(got.raw[name], want.raw[name])):
                sg, sw = got.model_statuses[name][i], want.model_statuses[name][i]
                assert sg in (Status.OK, Status.TRUNCATED), (name, i, sg)
                if not (step is steps[0] and i == 1):  # every input but the 100k one fits:
                    assert sg == sw and _same(g, w), (name, i, sg, sw, g, w)  # planning changes nothing
        if step is steps[0]:
            # The 100,000-character completion is cut, and that is said, never silent.
            assert got.model_statuses["rlhf_reward_model"][1] == Status.TRUNCATED
            # DPO cuts it too. Whether it also shrinks its logits chunk first depends on the chunk
            # tuned at load (by timing: 64 or 128 rows here) and on how tight its fit is; that
            # mechanism is tested with a fixed chunk in test_dpo's tight-budget test.
            assert got.model_statuses["dpo_reward_model"][1] == Status.TRUNCATED
            assert got.statuses[1] == Status.TRUNCATED
    assert planned.memory.ooms_total == len(real_ooms(planned))  # nothing injected: every OOM is a plan's


@pytest.mark.xfail(strict=True, reason="cost models under-fitted on purpose: planned batches must OOM")
def test_underfitted_cost_models_make_planned_batches_oom(standins, tmp_path) -> None:  # noqa: ANN001
    # The workload of the test above (its 100,000-character input reaches the models) under a
    # third of its budget: at 48 MiB even plans from 0.3x cost models now fit (the long DPO
    # suffix runs whole, without the quadratic mask), while at 16 MiB the fitted models plan no
    # OOM (checked) and the under-fitted ones do.
    planned = RewardStack(standin_config(standins, tmp_path / "a", memory_budget=16 * 1024**2,
                                         input={"max_chars": 200_000}), load_state=False)
    underfit(planned)
    for step in _steps(1, 1, 6, long_chars=100_000):
        planned.score_step(step, save=False)
    assert real_ooms(planned) == []


def test_injected_ooms_never_change_a_score(standins, tmp_path) -> None:  # noqa: ANN001
    clean = RewardStack(standin_config(standins, tmp_path / "a"), load_state=False)
    faulty = RewardStack(standin_config(standins, tmp_path / "b"), load_state=False)
    faulty.memory.injector = CountingInjector(rate=0.1, seed=3)
    steps = _steps(2, 8, 8)
    diverged = False  # an 'oom' raw value stays out of the normalizer, so later rewards may differ
    for step in steps:
        want = clean.score_step(step, save=False)
        got = faulty.score_step(step, save=False)
        for name in MODEL_SCORERS:
            for i, (g, w) in enumerate(zip(got.raw[name], want.raw[name])):
                status = got.model_statuses[name][i]
                assert _same(g, w) or status in (Status.OOM,), (name, i, g, w, status)
        # A step's own statistics include its values too: it diverges from its first 'oom' on.
        diverged = diverged or any(Status.OOM in sts for sts in got.model_statuses.values())
        if not diverged:
            for i, (g, w) in enumerate(zip(got.rewards, want.rewards)):
                assert _same(g, w), (i, g, w)
    injected = faulty.memory.injector.injected
    assert injected >= 5, "the injector should have fired several times"
    assert sum(r.injected for r in faulty.memory.oom_log) == injected
    assert all(r.model and r.lengths for r in faulty.memory.oom_log)


def test_budget_below_weights_still_scores_every_step(standins, tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    probe = RewardStack(standin_config(standins, tmp_path / "p"), load_state=False)
    total = weights_bytes([m for s in probe.scorers.values() for m in s.modules()])
    budget = total // 2
    with caplog.at_level(logging.INFO, logger="rewardstack"):
        stack = RewardStack(standin_config(standins, tmp_path / "s", memory_budget=budget), load_state=False)
        for step in _steps(3, 4, 5):
            res = stack.score_step(step, save=False)
            assert all(s in (Status.OK, Status.TRUNCATED) for s in res.statuses)
            assert all(math.isfinite(r) for r in res.rewards)
    assert real_ooms(stack) == []  # every planned batch fitted, swapped models included
    summary = stack.memory.placement.summary()
    wheres = {d["where"] for d in summary["models"].values()}
    assert wheres - {"resident"}, "with half the weights' bytes, some model must move"
    assert summary["swaps"] > 0
    assert summary["device_bytes"] <= budget
    text_log = caplog.text
    assert "placement" in text_log.lower() and "swap" in text_log.lower()
