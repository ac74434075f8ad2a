"""The scorer interface that every reward model and mask implements.

A scorer turns (prompt, completions, task) into one float per completion plus one status per
completion. It knows tensors and its model; it does not know about normalization, weights, other
scorers or validators. Batching, placement and OOM recovery are done by the memory layer
(`rewardstack._memory`), which a scorer reaches through the `Runtime` it is built with.
"""

from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._memory.guard import Outcome
    from rewardstack._memory.manager import MemoryManager
    from rewardstack._scorers.loading import ModelCache


class Status:
    """Per-completion statuses. `OK`, `TRUNCATED` and `CUT` carry a score; the others carry NaN."""

    OK = "ok"
    TRUNCATED = "truncated"  # scored, but the input was cut to the model's length bound or the budget
    CUT = "cut"  # scored on the first `[input] max_chars` characters only: the rest was never read
    FAILED = "failed"  # the miner's response failed (timeout, transport error): not scored
    OOM = "oom"  # every retry (split batches, CPU) ran out of memory: not scored
    ERROR = "error"  # the model raised something other than OOM: not scored

    SCORED = frozenset({OK, TRUNCATED, CUT})

    @staticmethod
    def worst(statuses: Sequence[str]) -> str:
        """The most severe of several statuses: one completion over every scorer (the stack), or one
        value over its windows or its encoders (the scorers); docs/SEMANTICS.md's order."""
        order = [Status.FAILED, Status.OOM, Status.ERROR, Status.CUT, Status.TRUNCATED, Status.OK]
        return next((s for s in order if s in statuses), Status.OK)


@dataclass
class ScoreRequest:
    """What a scorer is asked to score.

    `prompt` is the step's prompt for reward models and the base prompt for masks (the stack picks).
    `completions[i]` is None for a response that failed; scorers must give it NaN and `Status.FAILED`.
    """

    prompt: str
    completions: list[str | None]
    task: str = "augment"

    def live(self) -> list[int]:
        """Indices of completions that did not fail."""
        return [i for i, c in enumerate(self.completions) if c is not None]


@dataclass
class ScoreResult:
    """One float and one status per completion, in input order."""

    scores: list[float]
    statuses: list[str]

    @classmethod
    def failed_only(cls, request: ScoreRequest, status: str = Status.OK) -> "ScoreResult":
        """A result with every completion NaN; failed ones FAILED, others `status` (OK: to be filled)."""
        n = len(request.completions)
        return cls(
            scores=[math.nan] * n,
            statuses=[Status.FAILED if c is None else status for c in request.completions],
        )


def fill(res: ScoreResult, completions: Sequence[int], outcomes: Sequence["Outcome"], value: Callable[..., float], *,
         parts: int = 1, cut: Sequence[bool] | None = None) -> ScoreResult:
    """Write each completion's outcomes into `res`: NaN and the status of its first part that
    did not run ok, else `value(*its parts' values)`, TRUNCATED where `cut` says so.
    `outcomes` holds `parts` runs per completion, part by part (Dahoas: every text with the
    prompt, then every text alone); a status set before (TRUNCATED) stays when all ran ok."""
    n = len(completions)
    for k, i in enumerate(completions):
        mine = [outcomes[p * n + k] for p in range(parts)]
        failed = next((o.status for o in mine if o.status != Status.OK), None)
        if failed is not None:
            res.scores[i], res.statuses[i] = math.nan, failed
            continue
        res.scores[i] = value(*(o.value for o in mine))
        if cut is not None and cut[k]:
            res.statuses[i] = Status.TRUNCATED
    return res


@dataclass
class Runtime:
    """What the stack hands every scorer it builds: device, memory layer and shared model cache."""

    device: torch.device
    memory: "MemoryManager"
    models: "ModelCache"
    options: dict[str, Any] = field(default_factory=dict)


class Scorer(ABC):
    """A reward model or mask. Subclasses set `name` (the spec's event name) and `kind`."""

    name: str = ""
    kind: Literal["reward", "mask"] = "reward"
    stateful: bool = False
    """Whether the value depends on state carried from step to step (the blacklist's best answers,
    diversity's history). The stack keeps that state per validator (`RewardState`, which finishes
    the value) and runs only `stateless_part` with the forward passes; `score` alone runs both
    halves against the scorer's own state."""

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Score every completion of one step; never raises for a bad completion or OOM.

        A model's scorer fills in `_score_live`; a step without a live completion needs no model."""
        result = ScoreResult.failed_only(request)
        live = request.live()
        return self._score_live(request, live, result) if live else result

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        """`score` of a step with live completions (`live`): fill `result` (NaN, FAILED for the others)."""
        raise NotImplementedError(f"{type(self).__name__} scores through `score`")

    def stateless_part(self, request: ScoreRequest) -> list[tuple[Any, str]] | None:
        """A stateful scorer's forward pass: one (value, status) per live completion for the state to
        finish (diversity: the embeddings), or None when it needs no model (the blacklist)."""
        return None

    def begin_forward_pass(self) -> None:
        """Called once at the start of each validator forward pass (the blacklist resets here)."""

    def state_dict(self) -> dict[str, Any]:
        """State that must outlive the process (JSON-able values or tensors); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def modules(self) -> list[torch.nn.Module]:
        """The torch modules this scorer runs (for placement and weight accounting): its `model`, if any."""
        model = getattr(self, "model", None)
        return [model] if model is not None else []

    def attention_info(self) -> str:
        """Which attention the model runs when the scorer chose one (the operator log prints it)."""
        return ""
