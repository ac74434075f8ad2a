"""The causal scorers' shared outcome unpacking (`CausalScorer._fill`): what each completion gets
from its runs, failures in any part included (no model needed)."""

from __future__ import annotations

import math

from rewardstack._memory.guard import Outcome
from rewardstack._scorers.base import ScoreResult, Status
from rewardstack._scorers.causal import CausalScorer


def _result(n: int) -> ScoreResult:
    return ScoreResult([math.nan] * n, [Status.OK] * n)


def test_one_part_each() -> None:
    res = _result(4)
    res.statuses[2] = Status.TRUNCATED  # set before the run (cut to the bound): kept when it ran
    outcomes = [Outcome(0.5), Outcome(None, Status.OOM), Outcome(2.0), Outcome(None, Status.ERROR)]
    CausalScorer._fill(res, [0, 1, 2, 3], outcomes, float, cut=[False, True, False, True])
    assert res.scores[0] == 0.5 and res.scores[2] == 2.0
    assert math.isnan(res.scores[1]) and math.isnan(res.scores[3])
    assert res.statuses == [Status.OK, Status.OOM, Status.TRUNCATED, Status.ERROR]  # a failure is not "truncated"


def test_two_parts_each_part_by_part() -> None:
    """Dahoas: every completion's run with the prompt first, then every run alone; either part's
    failure fails the completion, the first failing part's status is the one reported."""
    res = _result(5)
    first = [Outcome(3.0), Outcome(1.0), Outcome(None, Status.ERROR), Outcome(5.0), Outcome(None, Status.OOM)]
    alone = [Outcome(1.0), Outcome(None, Status.OOM), Outcome(None, Status.OOM), Outcome(4.0), Outcome(2.0)]
    CausalScorer._fill(res, [0, 1, 2, 3, 4], first + alone, lambda a, b: a - b, parts=2,
                       cut=[False, False, False, True, False])
    assert res.scores[0] == 2.0 and res.scores[3] == 1.0
    assert all(math.isnan(res.scores[i]) for i in (1, 2, 4))
    assert res.statuses == [Status.OK, Status.OOM, Status.ERROR, Status.TRUNCATED, Status.OOM]


def test_only_the_named_completions_are_written() -> None:
    res = ScoreResult([math.nan, 7.0, math.nan], [Status.FAILED, Status.OK, Status.OK])
    CausalScorer._fill(res, [2], [Outcome(0.25)], float)
    assert res.scores[1:] == [7.0, 0.25] and math.isnan(res.scores[0]) and res.statuses[0] == Status.FAILED
