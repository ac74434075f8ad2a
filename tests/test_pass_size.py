"""How wide an encoder's forward passes get: the profiled shapes must reach the pass cap (the
planner admits nothing wider than what was profiled), and CPU tuning picks the cap by speed."""

from __future__ import annotations

import time

import pytest

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


def test_tuning_picks_wide_passes_only_when_they_pay() -> None:
    """Per-pass overhead: the widest cap wins. Cost by tokens alone: the narrowest stays."""
    overhead = lambda b, n: time.sleep(0.004)  # noqa: E731
    by_tokens = lambda b, n: time.sleep(b * n * 2e-5)  # noqa: E731 (per-call sleep overhead negligible)
    assert enc.tune_pass_tokens(overhead, 256) == 256 * enc.PASS_FACTORS[-1]
    assert enc.tune_pass_tokens(by_tokens, 256) == 256
    # A window pass slower than WINDOW_PASS_SLOW stops the tuning at one window (big models):
    # even a pure per-call cost is not timed further.
    slow = lambda b, n: time.sleep(enc.WINDOW_PASS_SLOW * 1.5)  # noqa: E731
    assert enc.tune_pass_tokens(slow, 256) == 256


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
    assert cap1 == cap2 and cap1 in [f * 512 for f in enc.PASS_FACTORS]
