"""A completion the recorded run cut stays `cut` when replayed.

rewardstack reads each text up to `[input] max_chars` characters; a completion past it is scored on
that head with status `cut`, and its event keeps only the head (the rest was never read). The event
says so: the status is `cut` and the kept text is exactly the head, so its length is where it was
cut. Replayed, that head is no longer than the limit, so the stack would read it whole and call it
`ok` (or `truncated` by the model's token bound), though the input it stands for was longer. The
values are the same either way (the models read the same characters); only the status would be
wrong. So the readers keep, per model, the completions whose recorded status was `cut`
(`RunStep.cut`), and replay marks a replayed status that carries a score `cut` again; a failure, an
OOM or an error on replay is kept, being what happened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, MutableSequence, Sequence

from rewardstack._scorers.base import Status
from rewardstack._stepobservers import StepObserver

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._replay.readers import RunStep
    from rewardstack.stack import RewardStack, StepResult


def mark_cut(model_statuses: Mapping[str, MutableSequence[str]], cut: Mapping[str, Sequence[int]],
             statuses: MutableSequence[str] | None = None) -> None:
    """Mark `cut` (per model, completion indices) in `model_statuses` in place, and in the step's `statuses`.

    A step's status is the most severe of its models' (`Status.worst`): one still scored becomes
    `cut` when one of its models now says `cut`; a failure, OOM or error outranks it and stays.
    """
    for model, indices in cut.items():
        sts = model_statuses.get(model)
        if sts is None:
            continue
        for i in indices:
            if i < len(sts) and sts[i] in Status.SCORED:
                sts[i] = Status.CUT
                if statuses is not None and i < len(statuses) and statuses[i] in Status.SCORED:
                    statuses[i] = Status.CUT


class KeepCut(StepObserver):
    """Marks the current recorded step's cut completions `cut` in each replayed result.

    It runs first among the stack's observers (`install`), so the operator's line, the telemetry
    and the event (which holds the same lists) all see the marked statuses.
    """

    def __init__(self) -> None:
        self.current: RunStep | None = None

    def step_scored(self, stack: "RewardStack", result: "StepResult") -> None:
        if self.current is not None and self.current.cut:
            mark_cut(result.model_statuses, self.current.cut, result.statuses)

    def install(self, stack: Any) -> "KeepCut":
        """Subscribe ahead of every other observer of `stack`."""
        stack.step_observers.insert(0, self)
        return self

    def remove(self, stack: Any) -> None:
        """Unsubscribe from `stack`."""
        if self in stack.step_observers:
            stack.step_observers.remove(self)


__all__ = ["KeepCut", "mark_cut"]
