"""Cost-model predictions of the prefix scorers' calls: within 15% of the measured peaks, no OOM.

Reciprocate and DPO run a step's shared prompt once and each batch in padding groups. Predicting
their calls as whole padded rectangles over the whole length (the one-token-prefix profile's
bound) over-predicted them by 1.5-5x (the run's report: 43.5% mean error for DPO, Reciprocate
1.5-2.6x); these tests score heavy-tailed steps on the tiny stand-ins and compare each call's
prediction with the tracker's measured peak, as the telemetry does.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any, Sequence

import pytest

from causal_fixtures import make_runtime, model_config
from rewardstack._memory.costmodel import CostModel, padding_groups, plan_batches, prefix_profile_shapes
from rewardstack._memory.manager import MemoryObserver
from rewardstack._memory.device import PeakWindow
from rewardstack._scorers import dpo, reciprocate
from rewardstack._scorers.base import ScoreRequest
from rewardstack._standins import make_dpo_standin, make_nsfw_standin, make_reciprocate_standin
from tests.soak.synthetic import heavy_tailed_lengths, text


class Calls(MemoryObserver):
    """(batch, padded length, predicted, measured) of every call, predicted as the monitor does."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.calls: list[tuple[int, int, float, int]] = []

    def batch(self, name: str, lengths: Sequence[int], forward: Any, cost: CostModel, on_host: bool,
              prefix: int = 0, completions: Any = None) -> Any:
        def observed(idx: list[int]) -> Any:
            window = PeakWindow("cpu", self.tracker)
            with window:
                out = forward(idx)
            length = max(lengths[i] for i in idx)
            self.calls.append((len(idx), length, cost.predict(len(idx), length, prefix), int(window.peak_increase or 0)))
            return out

        return observed


def _steps(n: int = 2, completions: int = 16) -> list[tuple[str, list[str | None]]]:
    rng = random.Random(7)
    return [(text(rng, 400), [text(rng, k) for k in heavy_tailed_lengths(rng, completions)]) for _ in range(n)]


def _errors(build: Any, budget: int | None = None, steps: tuple[int, int] = (2, 16)
            ) -> tuple[list[float], int, list[tuple[int, int, float, int]]]:
    runtime = make_runtime(budget)
    scorer = build(runtime)
    calls = Calls(runtime.memory.tracker)
    runtime.memory.subscribe(calls)
    for prompt, comps in _steps(*steps):
        scorer.score(ScoreRequest(prompt, comps))
    errs = [abs(m - p) / p for _, _, p, m in calls.calls if p > 0]
    return errs, runtime.memory.ooms_total, calls.calls


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("standins")
    return {"reciprocate": (root / "reciprocate", make_reciprocate_standin(root / "reciprocate")),
            "dpo": (root / "dpo", make_dpo_standin(root / "dpo"))}  # the 8k stand-in of the stack


def _reciprocate(folders: dict[str, tuple[Path, dict]]) -> Any:
    folder, entry = folders["reciprocate"]
    return lambda rt: reciprocate.build(model_config("reciprocate_reward_model", folder, entry), rt)


def _dpo(folders: dict[str, tuple[Path, dict]]) -> Any:
    folder, entry = folders["dpo"]
    return lambda rt: dpo.build(model_config("dpo_reward_model", folder, entry, options={"tune_logits_chunk": False,
                                                                                          "logits_chunk": 128}), rt)


@pytest.mark.slow  # two stand-in profiles (DPO's up to 8,192 tokens): tens of seconds on 2 cores
@pytest.mark.parametrize("scorer", ["reciprocate", "dpo"])
def test_prefix_scorer_predictions_within_15_percent(folders: dict[str, tuple[Path, dict]], scorer: str) -> None:
    build = _reciprocate(folders) if scorer == "reciprocate" else _dpo(folders)
    # DPO: one step of 48 (its batches then mix short and long inputs, as the bench's 50 do).
    errs, ooms, calls = _errors(build, steps=(2, 16) if scorer == "reciprocate" else (1, 48))
    assert ooms == 0
    # DPO measured 15.9% here with one sum of terms (2026-12-01), under 15% once its peak was
    # fitted as the larger of its two phases (`CostModel.alt`). What is left is mostly the
    # penalty's upper bound (random ids in the profile: every scored token distinct).
    assert statistics.fmean(errs) <= 0.15, (statistics.fmean(errs), calls)
    # Conservative where it matters: no call ran past its prediction by more than the planner's
    # 10% safety margin leaves room for.
    assert all(m <= p / 0.9 for _, _, p, m in calls), calls


@pytest.mark.slow
def test_budgeted_reciprocate_packs_without_oom(folders: dict[str, tuple[Path, dict]]) -> None:
    errs, ooms, calls = _errors(_reciprocate(folders), budget=3 * 2**20)
    assert ooms == 0
    assert statistics.fmean(errs) <= 0.15, calls
    assert max(m for *_, m in calls) <= 3 * 2**20


def test_planned_batches_are_the_rectangles_that_run() -> None:
    """With `slack`, no planned batch is split further into padding groups (what the scorer runs)."""
    lengths = [5, 100, 7, 8000, 90, 6, 120, 300, 310, 2000, 40, 41, 42]
    cost = CostModel(b=1.0)
    for batch in plan_batches(lengths, cost, float("inf"), slack=0.25):
        assert len(padding_groups([lengths[i] for i in batch])) == 1, batch


def test_prefix_prediction_bounds() -> None:
    """Never above the whole-length bound; a rate measured from a prefixed pass covers that pass."""
    cost = CostModel(b=100.0, samples=[(4, 64, 0), (4, 512, 0)])
    assert cost.predict(4, 512, prefix=300) == cost.predict(4, 512)  # no measured rate: the bound
    cost.fit_prefix([(4, 512, 256, 4 * 256 * 100 + 4 * 256 * 40)])
    assert cost.prefix_rate == pytest.approx(40.0)
    assert cost.predict(4, 512, 256) == pytest.approx(4 * 256 * 140)
    assert cost.predict(4, 512, 256) < cost.predict(4, 512)
    assert CostModel.from_dict(cost.to_dict()).predict(4, 512, 256) == cost.predict(4, 512, 256)
    assert prefix_profile_shapes([(1, 64), (8, 64), (1, 512), (4, 512)]) == [
        (1, 64, 32), (1, 512, 256), (4, 512, 256), (4, 512, 448), (8, 64, 32)]
    # A suffix shorter than any profiled length is charged at the shortest one, never extrapolated.
    assert cost.predict(4, 100, 90) == pytest.approx(4 * 64 * 100 + 4 * 36 * 40)


def test_prefix_cost_separates_the_suffix_attention() -> None:
    """Passes profiled after long prefixes (long suffixes) fit the prefix's cost per row and token
    and its suffix-by-prefix part apart: a short pass after a short prompt is predicted at its own
    cost, not at the rate the long passes showed, and no measured pass is predicted low."""
    cost = CostModel(b=100.0, c=1.0, samples=[(1, 64, 0), (1, 8192, 0)])
    rate, cross = 40.0, 0.5  # the "device": bytes per row per prefix token, and per prefix x suffix token

    def measured(b: int, l: int, p: int) -> int:
        return int(cost._bytes(b, l - p) + b * p * (rate + cross * (l - p)))

    shapes = [(1, 2048, 1024), (1, 4096, 2048), (1, 8192, 4096), (1, 8192, 7168)]
    cost.fit_prefix([(b, l, p, measured(b, l, p)) for b, l, p in shapes])
    for b, l, p in shapes:
        assert cost.predict(b, l, p) >= measured(b, l, p) - 1
    # A batch of 16 completions of 76 tokens after a 91-token prompt: within 1% of what it costs
    # (a single rate, the largest the long passes showed, would charge it about twice over).
    assert cost.predict(16, 167, 91) == pytest.approx(measured(16, 167, 91), rel=0.01)
    assert CostModel.from_dict(cost.to_dict()).predict(16, 167, 91) == cost.predict(16, 167, 91)


def test_lone_input_is_predicted_unpadded(tmp_path: Path) -> None:
    """An encoder's batch of one runs without a mask: its prediction is the unpadded pass's."""
    from rewardstack._scorers import classifier

    folder = tmp_path / "nsfw"
    entry = make_nsfw_standin(folder)
    runtime = make_runtime()
    # One 512-token window per pass, as the CPU's tuning usually picks: the pass size is timed at
    # load otherwise, and a busy machine picks 2,048 tokens, which would batch the windows.
    scorer = classifier.build_nsfw(model_config("nsfw_filter", folder, entry, options={"max_batch_tokens": 512}), runtime)
    calls = Calls(runtime.memory.tracker)
    runtime.memory.subscribe(calls)
    rng = random.Random(3)
    scorer.score(ScoreRequest("p", [text(rng, 4000)]))  # one input, cut into 512-token windows
    lone = [(p, m) for b, _, p, m in calls.calls if b == 1]
    assert lone and all(abs(m - p) / p <= 0.05 for p, m in lone), lone
