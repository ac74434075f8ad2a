"""A profile a tight budget asks for mid-run is bounded by `[memory] profile_seconds`, told to the
observers as a `ProfileRecord`, recorded by the telemetry as `profiling` and drawn by the report."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import pytest

from causal_fixtures import make_runtime, model_config
from rewardstack._memory.costmodel import ProfileCapped, profile
from rewardstack._memory.observers import MemoryObserver, ProfileRecord
from rewardstack._scorers import dpo
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_dpo_standin
from rewardstack._replay.synthetic import text
from telemetry_fixtures import SLOW_SHAPES, HogScorer, hog_config, step  # noqa: F401 - fixture


class Recorder(MemoryObserver):
    def __init__(self) -> None:
        self.records: list[ProfileRecord] = []

    def profiled(self, record: ProfileRecord) -> None:
        self.records.append(record)


def test_profile_stops_before_a_shape_that_would_end_past_the_cap() -> None:
    ran: list[tuple[int, int]] = []

    def slow(b: int, length: int) -> None:  # 1 ms per token: the grid below needs 1.0 s in all
        ran.append((b, length))
        time.sleep(1e-3 * b * length)

    shapes = [(1, 10), (1, 40), (2, 50), (4, 100)]  # 10, 40, 100 and 400 ms
    t0 = time.perf_counter()
    with pytest.raises(ProfileCapped) as e:
        profile(slow, lambda fn: fn() or 1, shapes, limit_s=0.3)
    seconds = time.perf_counter() - t0
    # The 400 ms shape was predicted (4 ms per token... at the last shape's rate) to end past the cap.
    assert (4, 100) not in ran and e.value.measured == len(ran) < len(shapes) and e.value.shapes == len(shapes)
    assert seconds < 0.3 + 0.15  # the cap, plus at most a shape's misprediction (here none)
    assert profile(slow, lambda fn: fn() or 1, shapes[:2], limit_s=10.0).to_dict()  # under the cap: a fit


LENGTH = 1024  # DPO's bound here: short profiles


@pytest.fixture(scope="module")
def dpo_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("standins") / "dpo"
    return folder, make_dpo_standin(folder)


def test_a_mid_run_profile_past_its_cap_is_stopped_and_the_step_still_scores(dpo_folder: tuple[Path, dict]) -> None:
    """The budget asks DPO for a smaller logits chunk inside the step; its profile is made slow
    (0.1 s a shape, ~1.5 s in all) against a 0.35 s cap: it stops, the measured 512-row setting
    stays, the long input is cut (never run out of memory) and the short one scores whole."""
    folder, entry = dpo_folder
    opts = {"logits_chunk": 512, "tune_logits_chunk": False}
    rt = make_runtime()
    sc = dpo.build(model_config("dpo_reward_model", folder, entry, max_length=LENGTH, options=opts), rt)
    prompt, comp = "Q: ", text(random.Random(5), 4 * LENGTH)
    n = len(sc.tokenizer(prompt + comp).input_ids)
    assert n < LENGTH
    rt.memory.set_budget(int(rt.memory.cost_model("dpo_reward_model").predict(1, n) * 0.4))
    seen = Recorder()
    rt.memory.subscribe(seen)
    rt.memory.profile_limit_s = 0.35
    fast = sc.chunks.profile

    def slow(b: int, length: int) -> None:
        time.sleep(0.1)
        fast(b, length)

    sc.chunks.profile = slow
    t0 = time.perf_counter()
    res = sc.score(ScoreRequest(prompt, [comp, comp[:200]]))
    seconds = time.perf_counter() - t0
    [rec] = seen.records
    assert rec.capped and rec.model == "dpo_reward_model" and "chunk=" in rec.name
    assert 0 < rec.measured < rec.shapes and rec.limit_s == 0.35 and rec.seconds < 0.35 + 0.3
    assert sc.chunks.chunk == 512 and rt.memory.oom_log.maxlen and list(rt.memory.oom_log) == []  # the measured setting
    assert res.statuses[0] == Status.TRUNCATED and math.isfinite(res.scores[0])
    assert res.statuses[1] == Status.OK and math.isfinite(res.scores[1])
    assert seconds < 30  # the uncapped profile of this step took minutes on a loaded 2-core machine
    # The capped setting is not profiled again: the next step pays nothing.
    sc.score(ScoreRequest(prompt, [comp]))
    assert len(seen.records) == 1


def _pixels(png: Path, color: str) -> int:
    """Pixels of `png` within 2/255 of `color` (#rrggbb)."""
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png)[..., :3]
    want = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - want).max(axis=-1) <= 2 / 255).sum())


def test_the_telemetry_records_profiling_and_the_report_draws_and_counts_it(hog_config, tmp_path: Path) -> None:  # noqa: ANN001
    from rewardstack.stack import RewardStack
    from rewardstack._telemetry import Monitor, RunDir, read_timeline
    from rewardstack._telemetry.report import PROFILING_COLOR, write_report

    HogScorer.profile_in_step = 2  # the second step's hog call asks for a profile: 0.6 s against a 0.25 s cap
    stack = RewardStack(hog_config(memory={"profile_seconds": 0.25}), load_state=False)
    assert stack.memory.profile_limit_s == 0.25
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    for k in range(3):
        stack.score_step(step(k), save=False)
    mon.close()
    records = list(read_timeline(tmp_path / "run"))
    [prof] = [r for r in records if r["type"] == "profiling"]
    assert prof["step"] == 2 and prof["capped"] and prof["model"] == "rlhf_reward_model"
    assert 0 < prof["measured"] < prof["shapes"] == len(SLOW_SHAPES) and prof["limit_s"] == 0.25
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert steps[2]["profiles"] == 1 and 0 < steps[2]["profiling_seconds"] <= steps[2]["seconds"]
    assert steps[1]["profiling_seconds"] == steps[3]["profiling_seconds"] == 0
    page, text = write_report(tmp_path / "run")
    html = page.read_text(encoding="utf-8")
    assert "Profiling inside steps" in html and "1 profiles inside steps" in html and "stopped at its 0.25 s cap" in html
    assert "rlhf_reward_model[slow]" in text
    # Drawn as its own band (not the grey "outside model calls") in the step-time timeline.
    assert _pixels(page.parent / "step_time_by_model.png", PROFILING_COLOR) > 50
