"""No profile runs inside a request: a budget met inside a step is planned within what was measured
at load, a profile asked for there is refused, and the telemetry and the report say none ran."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime, model_config
from rewardstack._memory import MemoryManager, MemoryObserver, Profile
from rewardstack._memory.calibration import ProfileRecord
from rewardstack._scorers import dpo
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_dpo_standin
from tests.soak.synthetic import text
from telemetry_fixtures import HOG, HogScorer, hog_config, step  # noqa: F401 - fixture


class Recorder(MemoryObserver):
    def __init__(self) -> None:
        self.records: list[ProfileRecord] = []

    def profiled(self, record: ProfileRecord) -> None:
        self.records.append(record)


def test_a_profile_asked_for_inside_a_request_is_refused() -> None:
    ran: list[tuple[int, int]] = []
    mm = MemoryManager(None)
    seen = Recorder()
    mm.subscribe(seen)
    with mm.serving(), pytest.raises(RuntimeError, match="no profile runs inside a request"):
        mm.calibrate(Profile("m", lambda b, n: ran.append((b, n)), max_length=64, shapes=[(1, 8), (2, 16)]))
    assert ran == [] and seen.records == [] and "m" not in mm.cost_models
    mm.calibrate(Profile("m", lambda b, n: ran.append((b, n)) or torch.ones(b, n).sum(), max_length=64,
                         shapes=[(1, 8), (2, 16)]))  # outside a request (at load): profiled
    assert ran == [(1, 8), (2, 16)] and [r.name for r in seen.records] == ["m"]


LENGTH = 1024  # DPO's bound here: short profiles


@pytest.fixture(scope="module")
def dpo_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("standins") / "dpo"
    return folder, make_dpo_standin(folder)


def test_a_budget_met_inside_a_step_profiles_nothing_and_the_step_still_scores(dpo_folder: tuple[Path, dict]) -> None:
    """A budget set after load, too small for DPO's measured 512-row logits chunk, is met inside the
    step: nothing is profiled there (a profile would be slow here: 0.1 s a shape), the measured
    512-row setting stays, the long input is cut to what it holds (never run out of memory) and
    the short one scores whole."""
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
    fast = sc.chunks.profile

    def slow(b: int, length: int) -> None:
        time.sleep(0.1)
        fast(b, length)

    sc.chunks.profile = slow
    t0 = time.perf_counter()
    res = sc.score(ScoreRequest(prompt, [comp, comp[:200]]))
    seconds = time.perf_counter() - t0
    assert seen.records == []  # no profile inside the step
    assert sc.chunks.chunk == 512 and rt.memory.oom_log.maxlen and list(rt.memory.oom_log) == []  # the measured setting
    assert res.statuses[0] == Status.TRUNCATED and math.isfinite(res.scores[0])
    assert res.statuses[1] == Status.OK and math.isfinite(res.scores[1])
    assert seconds < 30  # a profile inside this step took minutes on a loaded 2-core machine
    # The next step pays nothing either.
    sc.score(ScoreRequest(prompt, [comp]))
    assert seen.records == []


def _pixels(png: Path, color: str) -> int:
    """Pixels of `png` within 2/255 of `color` (#rrggbb)."""
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png)[..., :3]
    want = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - want).max(axis=-1) <= 2 / 255).sum())


def test_the_telemetry_and_the_report_see_no_profile_inside_steps(hog_config, tmp_path: Path) -> None:  # noqa: ANN001
    from rewardstack.stack import RewardStack
    from rewardstack._telemetry.monitor import Monitor
    from rewardstack._telemetry.rundir import RunDir, read_timeline
    from rewardstack._telemetry.report import write_report

    HogScorer.profile_in_step = 2  # the second step's hog call asks for a profile: refused
    stack = RewardStack(hog_config(), load_state=False)
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    for k in range(3):
        stack.score_step(step(k), save=False)
    mon.close()
    hog = stack.scorers[HOG]
    assert hog.refused == 1 and "rlhf_reward_model[slow]" not in stack.memory.cost_models
    records = list(read_timeline(tmp_path / "run"))
    assert [r for r in records if r["type"] == "profiling"] == []
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert sorted(steps) == [1, 2, 3] and all(s["profiles"] == 0 and s["profiling_seconds"] == 0 for s in steps.values())
    assert all(r["outcome"] == "ok" for r in records if r["type"] == "call")  # the step scored as usual
    page, text = write_report(tmp_path / "run")
    html = page.read_text(encoding="utf-8")
    assert "Profiling inside steps" in html and "none: every cost model came from the load-time calibration" in html
