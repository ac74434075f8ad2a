"""What the stack tells its subscribers about each step, and the step's memory record.

A subscriber derives from `StepObserver`, overrides the hooks it needs and is added to
`RewardStack.step_observers`. For each step `RewardStack.score_step` calls, in order:

- `step_started(stack, name)` before the forward passes;
- `step_ended(stack)` when the step's work is over, whether it raised or not;
- `step_scored(stack, result)` once the result is applied to the state (`result.sequence` is
  its sequence number), before the state is saved: the operator's INFO line (`rewardstack._oplog`).

Then, when anyone asks for it (an observer with `wants_records`, or an `on_step` callback),
`RewardStack.publish_step` builds the step's memory record (`step_record`: statuses, memory at
rest) and calls `step_done(report)` on each observer that wants records, in order, before the
`on_step` callbacks receive the record: an observer (the telemetry monitor) fills in what it
measured (per-model calls, peaks, OOMs, alarms) and later callbacks see its additions. The service
publishes the steps it commits the same way; each applied to its namespace's state, so a record's
`step` is `result.sequence` (the index in the state that applied it), never the stack's own count.
Record fields: docs/TELEMETRY.md.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from rewardstack.config import StackConfig
from rewardstack._memory import MemoryManager
from rewardstack._memory.device import MemorySnapshot
from rewardstack._stepresult import StepResult


class ScoringStack(Protocol):
    """What an observer reads of the stack that calls it (`rewardstack.stack.RewardStack`): a
    protocol, so that observers and the stack do not import each other."""

    config: StackConfig
    memory: MemoryManager
    scorers: Mapping[str, Any]
    device: torch.device

    @property
    def steps_scored(self) -> int: ...


@dataclass
class StepReport:
    """One published step: its result, its memory record and the snapshot the record was read from."""

    stack: ScoringStack
    result: StepResult
    record: dict[str, Any]
    snapshot: MemorySnapshot


class StepObserver:
    """A subscriber of the stack's steps; every hook does nothing unless overridden."""

    wants_records = False
    """Whether `publish_step` should build the memory record and call `step_done`."""

    def step_started(self, stack: ScoringStack, name: str) -> None:
        """A step named `name` begins (before its forward passes)."""

    def step_ended(self, stack: ScoringStack) -> None:
        """The step's work is over (also when it raised)."""

    def step_scored(self, stack: ScoringStack, result: StepResult) -> None:
        """The step was applied to the stack's state; `result.sequence` is its sequence number."""

    def step_done(self, report: StepReport) -> None:
        """The step's memory record is built (observers with `wants_records` only)."""


def declared_growth(stack: Any) -> dict[str, int]:
    """Bytes of the stack's bounded, expected growth: the diversity history (until it is full).

    Any object of the stack's state or scorers with a `history` tensor counts, on the host or the
    device where that tensor lives. The alarms subtract it before looking for a trend.
    """
    out = {"host": 0, "device": 0}
    state = getattr(stack, "state", None)
    seen: set[int] = set()
    for obj in [getattr(state, "diversity", None), *getattr(stack, "scorers", {}).values()]:
        h = getattr(obj, "history", None)
        if isinstance(h, torch.Tensor) and id(h) not in seen:
            seen.add(id(h))
            out["host" if h.device.type == "cpu" else "device"] += h.numel() * h.element_size()
    return out


def step_record(stack: ScoringStack, result: StepResult, snap: MemorySnapshot) -> dict[str, Any]:
    """The memory record of the step just scored, from what the stack knows and a snapshot taken now.

    The per-model breakdown (`models`, `calls`, `ooms`, `peak_bytes`, `budget_line_bytes`) is left
    empty for an observer that watched the calls (the telemetry monitor) to fill in.
    """
    event = result.event
    statuses = event.get("statuses", [])
    # The index in the state that applied the step: in the service that is the namespace's state,
    # and the stack's own (`stack.steps_scored`) never moves.
    index = result.sequence if result.sequence is not None else stack.steps_scored
    return {
        "type": "step", "step": int(index), "name": event.get("name"), "time": time.time(),
        "seconds": event.get("step_length"), "completions": len(statuses), "statuses": dict(Counter(statuses)),
        "model_statuses": {k: dict(Counter(v)) for k, v in event.get("model_statuses", {}).items()},
        "models": {}, "calls": None, "ooms": None, "peak_bytes": None, "rest": snap.to_dict(),
        "budget_bytes": stack.memory.budget_bytes, "budget_line_bytes": None, "declared": declared_growth(stack),
        "alarms": [],
    }
