"""What a memory budget changed: each input whose status under the budget differs from the run
without one (cut to fit, or lost to an OOM), so `replay --budget` says `fits` only when none did.

A budget may cut an input further than the model's own bound (`truncated`) or lose it (`oom`);
either changes its score, so "no OOM" is not "fits". The comparison is made per model and per
completion against the same stack with its budget lifted, and only for the steps where the
budgeted run gave some status other than `ok` or `failed` (the stateless forward pass alone: a
status never depends on the state), so a run the budget did not touch costs nothing extra. A
completion the recorded run cut is marked `cut` in the unbudgeted pass too (`recorded_cut`), as it
is in the budgeted run, so the mark is not taken for a change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from rewardstack._replay.recorded_cut import mark_cut

UNTOUCHED = ("ok", "failed")
"""Statuses the budget cannot have caused (a completion `ok` under the budget was not cut)."""


@dataclass(frozen=True)
class Changed:
    """One input whose status under the budget differs from the unbudgeted run."""

    step: int
    """0-based position in the replayed run."""
    index: int
    """The completion's index in its step."""
    model: str
    unbudgeted: str
    budgeted: str
    chars: int
    """The completion's length in characters (to find it)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)

    def describe(self) -> str:
        """'step 3, completion 1 (30,000 chars), dpo_reward_model: ok -> truncated'."""
        return (f"step {self.step}, completion {self.index} ({self.chars:,} chars), {self.model}: "
                f"{self.unbudgeted} without the budget -> {self.budgeted}")


def needs_check(model_statuses: Mapping[str, Sequence[str]]) -> bool:
    """Whether a step's budgeted statuses hold one the budget may have caused."""
    return any(s not in UNTOUCHED for sts in model_statuses.values() for s in sts)


def changed_by_budget(stack: Any, steps: Sequence[Any], budgeted: Sequence[Mapping[str, Sequence[str]]],
                      raws: Sequence[Mapping[str, Sequence[float]]] | None = None, tol: float = 1e-4) -> list[Changed]:
    """Inputs whose status differs between `budgeted` (per step: model -> statuses) and `stack`
    with its activation budget lifted; `steps[i].step` is the Step. With `raws` (the budgeted raw
    values), a scored input whose value moved past `tol` (relative) counts too: cut further than
    the model's own bound, it is `truncated` (or `cut`) both ways. The budget is restored after."""
    todo = [pos for pos, sts in enumerate(budgeted) if needs_check(sts)]
    if not todo:
        return []
    saved = stack.memory.budget_bytes
    out: list[Changed] = []
    stack.memory.set_budget(None)
    try:
        for pos in todo:
            step = steps[pos].step
            free = stack.forward(step)
            mark_cut({m: r.statuses for m, r in free.results.items()}, getattr(steps[pos], "cut", {}))
            for model, sts in budgeted[pos].items():
                res = free.results.get(model)
                if res is None:
                    continue
                values = raws[pos].get(model) if raws is not None else None
                for i, (b, u) in enumerate(zip(sts, res.statuses)):
                    text = step.completions[i] or ""
                    if str(b) != str(u):
                        out.append(Changed(pos, i, model, str(u), str(b), len(text)))
                    elif values is not None and str(b) in ("ok", "truncated", "cut"):
                        x, y = float(values[i]), float(res.scores[i])
                        if math.isfinite(x) and math.isfinite(y) and abs(x - y) > tol * max(1.0, abs(y)):
                            out.append(Changed(pos, i, model, f"{u} {y:.6g}", f"{b} {x:.6g}", len(text)))
    finally:
        stack.memory.set_budget(saved)
    return out
