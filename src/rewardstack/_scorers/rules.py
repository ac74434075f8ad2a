"""The two rule-based masks: blacklist and task validator (no model, exact openvalidators rules)."""

from __future__ import annotations

from typing import Any

from rewardstack.config import ModelConfig
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult
from rewardstack._models import BLACKLIST, TASK_VALIDATOR

BLACKLISTED_PHRASE = "That is an excellent question."

SUMMARY_KEYWORDS = ("Summary:", "Paraphrase:", "Paraphrasing:", "Paraphrased:")
QUESTION_KEYWORDS = ("Question:", "Query:", "Q:")
ANSWER_KEYWORDS = ("Answer:", "Response:", "A:", "Completion:")


def _rule_result(request: ScoreRequest, fn) -> ScoreResult:  # noqa: ANN001
    result = ScoreResult.failed_only(request)
    for i, c in enumerate(request.completions):
        if c is not None:
            result.scores[i] = fn(c)
    return result


class BlacklistState:
    """The blacklist's state: best questions and answers of the forward pass in progress.

    The mask's value depends only on this state and the text (no model), so the stateful part of
    the stack (`rewardstack.stack.RewardState`) holds one per namespace and runs it there.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the best questions and answers of the previous forward pass."""
        self.question_blacklist: list[str] = []
        self.answer_blacklist: list[str] = []

    def record_best(self, task: str, best: str) -> None:
        """Remember a step's best completion: followup steps add questions, answer steps answers."""
        if task.startswith("followup"):
            self.question_blacklist.append(best)
        elif task.startswith("answer"):
            self.answer_blacklist.append(best)

    def score(self, request: ScoreRequest) -> ScoreResult:
        """1.0 unless a completion is blacklisted."""
        banned = {BLACKLISTED_PHRASE, request.prompt, *self.question_blacklist, *self.answer_blacklist}
        return _rule_result(request, lambda c: 0.0 if c in banned else 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The lists of the forward pass in progress (a restart mid-pass keeps them)."""
        return {"question_blacklist": list(self.question_blacklist), "answer_blacklist": list(self.answer_blacklist)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the lists."""
        self.question_blacklist = [str(x) for x in state.get("question_blacklist", [])]
        self.answer_blacklist = [str(x) for x in state.get("answer_blacklist", [])]


class Blacklist(BlacklistState, Scorer):
    """0 for the stock phrase, the base prompt itself, or a best question/answer of this forward pass.

    Used alone, the scorer is its own `BlacklistState`; the stack keeps one per namespace.
    """

    name = BLACKLIST.name
    kind = "mask"
    stateful = True  # no model: the whole value comes from the state

    def begin_forward_pass(self) -> None:
        """Forget the best questions and answers of the previous forward pass."""
        self.reset()


def task_validator_value(task: str, completion: str) -> float:
    """The task validator rule for one completion (case-insensitive substring tests)."""
    text = completion.lower()
    has = lambda kws: any(k.lower() in text for k in kws)  # noqa: E731
    summary_task = task == "augment"
    question_task = task.startswith("followup")
    answer_task = task.startswith("answer")
    if (summary_task or question_task) and has(ANSWER_KEYWORDS):
        return 0.0
    if (summary_task or answer_task) and has(QUESTION_KEYWORDS):
        return 0.0
    if not summary_task and has(SUMMARY_KEYWORDS):
        return 0.0
    return 1.0


class TaskValidator(Scorer):
    """0 when a completion carries the keywords of another task kind."""

    name = TASK_VALIDATOR.name
    kind = "mask"

    def score(self, request: ScoreRequest) -> ScoreResult:
        """1.0 unless a completion looks like another task's output."""
        return _rule_result(request, lambda c: task_validator_value(request.task, c))


def build_blacklist(cfg: ModelConfig, runtime: Runtime) -> Blacklist:
    """The blacklist mask (no model)."""
    return Blacklist()


def build_task_validator(cfg: ModelConfig, runtime: Runtime) -> TaskValidator:
    """The task validator mask (no model)."""
    return TaskValidator()

