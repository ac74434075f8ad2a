"""What the models read of a step: every text cut to `[input] max_chars`, and what was cut.

`ReadView.of(step, max_chars)` is the step the stack's forward pass scores (and the service's
digest of a committed step reads); `mark` and `mark_embeddings` mark CUT what was scored from a
cut text. Its own module in the stack's layer, so that the service reads it without reaching
into the stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rewardstack._scorers.base import ScoreResult, Status
from rewardstack._scorers.embedding import Embedding
from rewardstack._wire import Step


@dataclass
class ReadView:
    """What the models read of a step: every text cut to `[input] max_chars`, and what was cut."""

    step: Step
    prompt_cut: bool
    base_cut: bool
    cut: list[bool]
    """Per completion: whether its text was cut."""

    @classmethod
    def of(cls, step: Step, max_chars: int) -> "ReadView":
        def cut(text: str | None) -> tuple[str | None, bool]:
            if text is None or len(text) <= max_chars:
                return text, False
            return text[:max_chars], True

        prompt, p_cut = cut(step.prompt)
        base, b_cut = cut(step.base_prompt)
        comps = [cut(c) for c in step.completions]
        if not (p_cut or b_cut or any(c for _, c in comps)):
            return cls(step, False, False, [False] * len(comps))
        view = dataclasses.replace(step, prompt=prompt, base_prompt=base, completions=[t for t, _ in comps])
        return cls(view, p_cut, b_cut if step.base_prompt is not None else p_cut, [c for _, c in comps])

    def mark(self, res: ScoreResult, *, mask: bool) -> ScoreResult:
        """`res` with every scored completion whose input (text or prompt) was cut marked CUT."""
        whole = self.base_cut if mask else self.prompt_cut
        for i, c in enumerate(self.cut):
            if (c or whole) and res.statuses[i] in Status.SCORED:
                res.statuses[i] = Status.CUT
        return res

    def mark_embeddings(self, embs: list[Embedding]) -> list[Embedding]:
        """Diversity's (vector, status) per live completion, CUT where that completion was cut."""
        live = [i for i, c in enumerate(self.step.completions) if c is not None]
        return [(v, Status.CUT if (self.cut[i] or self.base_cut) and st in Status.SCORED else st)
                for i, (v, st) in zip(live, embs)]


__all__ = ["ReadView"]
