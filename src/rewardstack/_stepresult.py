"""What scoring one step gives back (`StepResult`): the stack makes it, its observers read it.

A module of its own so that the step observers (stepobservers.py, oplog.py) and the stack share
the type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What scoring one step gives back."""

    rewards: list[float]
    best: str
    raw: dict[str, list[float]]
    normalized: dict[str, list[float]]
    statuses: list[str]
    """One status per completion: the most severe over every active scorer."""
    model_statuses: dict[str, list[str]]
    event: dict[str, Any] = field(default_factory=dict)
    sequence: int | None = None
    """The step's index in the state that applied it (`RewardState.steps_scored` after it): the
    service applies steps to each namespace's state, not the stack's, so the records read it here."""


__all__ = ["StepResult"]
