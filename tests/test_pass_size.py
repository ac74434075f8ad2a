"""How wide an encoder's forward passes get: the profiled shapes must reach the pass cap (the
planner admits nothing wider than what was profiled), and CPU tuning picks the cap by speed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from encoder_fixtures import config, make_runtime, standin_root
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._scorers.classifier import build_nsfw


@pytest.fixture(scope="module")
def stand(tmp_path_factory):  # noqa: ANN001, ANN201
    return standin_root(tmp_path_factory)


def _count_passes(model) -> list[tuple[int, int]]:  # noqa: ANN001
    shapes: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    return shapes


def test_short_completions_share_passes_up_to_the_cap(stand) -> None:  # noqa: ANN001
    """50 short completions under a fixed 512-token cap: a few passes, not one per 4 rows.

    With the old profile grid (batches up to 4) the planner refused every wider batch and this
    step took 13 passes; the cost model must admit what the cap allows."""
    root, entries = stand
    sc = build_nsfw(config("nsfw_filter", root, entries["nsfw_filter"], options={"max_batch_tokens": 512}), make_runtime())
    assert sc.max_tokens == 512  # set in the config: not tuned
    shapes = _count_passes(sc.model)
    res = sc.score(ScoreRequest("p", [f"answer number {k} is short" for k in range(50)]))
    assert all(s == Status.OK for s in res.statuses)
    assert sum(b for b, _ in shapes) == 50
    assert len(shapes) <= 4, shapes
    assert all(b * w <= 512 for b, w in shapes)  # and never past the cap


def test_profile_grid_reaches_the_cap() -> None:
    shapes = enc.pass_shapes(512, 2048)
    assert max(b * n for b, n in shapes) == 2048
    assert (4, 512) in shapes and max(b for b, _ in shapes) == enc.MAX_PASS_ROWS
    assert {(1, n) for n in (64, 128, 256, 512)} <= set(shapes)  # every length alone
    assert max(b * n for b, n in enc.pass_shapes(512, 512)) == 512


class FakeClock:
    """Timings handed in: `run(B, L)` advances the clock by `cost(B, L, k)` (k: the call's number)
    instead of running a model, and the tuner reads this clock."""

    def __init__(self, cost) -> None:  # noqa: ANN001
        self.now, self.calls, self.cost = 0.0, 0, cost

    def perf_counter(self) -> float:
        return self.now

    def run(self, b: int, n: int, padded: bool = True) -> None:
        self.now += self.cost(b, n, self.calls)
        self.calls += 1


def _tune(monkeypatch: pytest.MonkeyPatch, cost, bound: int) -> int:  # noqa: ANN001
    clock = FakeClock(cost)
    monkeypatch.setattr(enc, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    return enc.tune_pass_tokens(clock.run, bound)


PLAN = enc.default_pass_tokens(512, torch.device("cpu"))


def realistic(b: int, n: int, k: int) -> float:
    """The 6-layer, 384-wide Llama reward model of issue 48 on one core: ~0.35 s per 512-token
    window, and 5 ms a pass of fixed cost."""
    return 0.005 + b * n * 0.35 / 512


def test_a_slow_model_keeps_the_plans_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window pass of 0.35 s once stopped the tuning at one window (WINDOW_PASS_SLOW): 7.7
    samples/s where 4,096 tokens a pass gave 11.0. The pass size is the plan's."""
    assert _tune(monkeypatch, realistic, 512) == PLAN >= 8 * 512


@pytest.mark.parametrize("spike_at", range(30))
def test_one_slow_measurement_does_not_shrink_the_pass(monkeypatch: pytest.MonkeyPatch, spike_at: int) -> None:
    """Another process takes the cores during one pass (5x its time): the pass stays the plan's,
    wherever in the timing that pass falls."""
    def cost(b: int, n: int, k: int) -> float:
        return realistic(b, n, k) * (5 if k == spike_at else 1)

    assert _tune(monkeypatch, cost, 512) == PLAN > 512


def test_a_load_that_slows_every_pass_does_not_shrink_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load that comes and goes between rounds (each round 1x to 3x slower, both sizes alike)."""
    def cost(b: int, n: int, k: int) -> float:
        return realistic(b, n, k) * (1 + 2 * ((k // 3) % 2))

    assert _tune(monkeypatch, cost, 512) == PLAN > 512


def cache_bound(b: int, n: int, k: int) -> float:
    """Per-token cost 1.5x once a pass holds more than 2,048 tokens (its activations fall out of
    cache), 2 ms a pass of fixed cost."""
    return 0.002 + b * n * 1e-5 * (1.5 if b * n > 2048 else 1.0)


def test_a_pass_genuinely_slower_when_larger_is_halved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's 4,096-token pass is 1.4x slower than two of 2,048 in every round and in the
    re-check: 2,048 is taken; 1,024 (more passes, the same rate) is not faster, so it stops there."""
    assert _tune(monkeypatch, cache_bound, 512) == 2048


def test_a_small_model_never_drops_to_one_row_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-token model was tuned to one window (one row a pass: 42 s for 254 inputs that one
    padded pass ran in 0.39 s). Even where smaller passes time faster it keeps 64 rows."""
    def small_faster(b: int, n: int, k: int) -> float:
        return b * n * 1e-6 * (b * n) ** 0.5

    tokens = _tune(monkeypatch, small_faster, 64)
    assert tokens >= enc.MAX_PASS_ROWS * 64, tokens


def test_tuned_cap_is_read_back_from_the_calibration_cache(stand, tmp_path) -> None:  # noqa: ANN001
    """A warm start gets the tuned cap from the cache without timing anything again."""
    from rewardstack._memory.calibration import CalibrationCache

    root, entries = stand
    cfg = config("nsfw_filter", root, entries["nsfw_filter"])
    path = tmp_path / "cal.json"
    caps = []
    for _ in range(2):
        rt = make_runtime()
        rt.memory.calibration = CalibrationCache(path)
        rt.memory.describe_model(cfg)
        sc = build_nsfw(cfg, rt)
        caps.append((sc.max_tokens, list(rt.memory.profiled)))
    (cap1, prof1), (cap2, prof2) = caps
    assert prof1 == ["nsfw_filter"] and prof2 == []
    plan = enc.default_pass_tokens(512, torch.device("cpu"))
    assert cap1 == cap2 and cap1 in (plan, plan // 2, plan // 4)


def test_a_busy_machine_keeps_the_plans_pass_and_a_quiet_start_times_it_again(
        stand, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Timed while the timing thread ran 40% of the wall time, the pass is the plan's whatever was
    measured, and the cache entry is timed again by the first start that finds the machine quiet."""
    from rewardstack._memory import calibration
    from rewardstack._memory.calibration import CalibrationCache

    root, entries = stand
    cfg = config("nsfw_filter", root, entries["nsfw_filter"])
    path = tmp_path / "cal.json"
    plan = enc.default_pass_tokens(512, torch.device("cpu"))
    monkeypatch.setattr(enc, "tune_pass_tokens", lambda run, bound, planned=None, **kw: 1024)  # what a busy timing says

    def start(share: float) -> tuple[int, list[str]]:
        monkeypatch.setattr(calibration, "cpu_clock", lambda: share * time.perf_counter(), raising=False)
        rt = make_runtime()
        rt.memory.calibration = CalibrationCache(path)
        rt.memory.describe_model(cfg)
        sc = build_nsfw(cfg, rt)
        return sc.max_tokens, list(rt.memory.profiled)

    assert start(0.4) == (plan, ["nsfw_filter"])  # busy: the plan's pass, not the measured 1,024
    assert start(0.4) == (plan, [])  # still busy: the entry serves
    assert start(1.0) == (1024, ["nsfw_filter"])  # quiet: timed again
    assert start(1.0) == (1024, [])  # and kept
