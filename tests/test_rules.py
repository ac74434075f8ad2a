"""The blacklist and task-validator masks against the spec's rules."""

from __future__ import annotations

import math

import pytest

from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._scorers.rules import Blacklist, TaskValidator, task_validator_value


@pytest.mark.parametrize(
    "task, text, want",
    [
        ("augment", "A plain summary of the text.", 1.0),
        ("augment", "Summary: fine for a summary task", 1.0),
        ("augment", "answer: lowercase keyword still counts", 0.0),
        ("augment", "What? Q: a question keyword", 0.0),
        ("followup0", "Why is the sky blue?", 1.0),
        ("followup1", "Question: why?", 1.0),
        ("followup2", "Response: here", 0.0),
        ("followup3", "PARAPHRASE: nope", 0.0),
        ("answer0", "Because of Rayleigh scattering.", 1.0),
        ("answer1", "Completion: yes", 1.0),
        ("answer2", "query: what", 0.0),
        ("answer3", "Paraphrased: x", 0.0),
        ("other", "Answer: and Question: are fine for unknown tasks", 1.0),
        ("other", "Summary: is not", 0.0),
        ("augment", "", 1.0),
        ("answer0", "Qatar is a country", 1.0),  # 'Q:' needs the colon
        ("answer0", "AQ: tricky", 0.0),  # substring test, as the reference
    ],
)
def test_task_validator_rules(task: str, text: str, want: float) -> None:
    assert task_validator_value(task, text) == want


def test_task_validator_is_exact_about_augment() -> None:
    # The reference compares the name with 'augment' exactly.
    assert task_validator_value("augmented", "Summary: x") == 0.0


def test_blacklist_rules_and_reset() -> None:
    bl = Blacklist()
    req = ScoreRequest("the base prompt", ["That is an excellent question.", "the base prompt", "fine", None], "followup0")
    res = bl.score(req)
    assert res.scores[:3] == [0.0, 0.0, 1.0] and math.isnan(res.scores[3])
    assert res.statuses == [Status.OK, Status.OK, Status.OK, Status.FAILED]
    bl.record_best("followup0", "best question?")
    bl.record_best("answer0", "best answer.")
    bl.record_best("augment", "a summary")  # summaries are not blacklisted
    res = bl.score(ScoreRequest("p", ["best question?", "best answer.", "a summary"], "answer1"))
    assert res.scores == [0.0, 0.0, 1.0]
    state = bl.state_dict()
    other = Blacklist()
    other.load_state_dict(state)
    assert other.score(ScoreRequest("p", ["best answer."])).scores == [0.0]
    bl.begin_forward_pass()
    assert bl.score(ScoreRequest("p", ["best question?", "best answer."])).scores == [1.0, 1.0]


def test_rule_masks_on_empty_step() -> None:
    assert Blacklist().score(ScoreRequest("p", [])).scores == []
    assert TaskValidator().score(ScoreRequest("p", [], "augment")).statuses == []
