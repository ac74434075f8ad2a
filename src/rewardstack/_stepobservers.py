"""What the stack tells its subscribers about each step, and the step's memory record.

A subscriber derives from `StepObserver`, overrides the hooks it needs and is added to
`RewardStack.step_observers`. For each step `RewardStack.score_step` calls, in order:

- `step_started(stack, name)` before the forward passes;
- `step_ended(stack)` when the step's work is over, whether it raised or not;
- `step_scored(stack, result)` once the result is applied to the state (`result.sequence` is
  its sequence number), before the state is saved: the operator's INFO line (`OperatorLog`).

Then, when anyone asks for it (an observer with `wants_records`, or an `on_step` callback),
`RewardStack.publish_step` builds the step's memory record (`step_record`: statuses, memory at
rest) and calls `step_done(report)` on each observer that wants records, in order, before the
`on_step` callbacks receive the record: an observer (the telemetry monitor) fills in what it
measured (per-model calls, peaks, OOMs, alarms) and later callbacks see its additions. The service
publishes the steps it commits the same way; each applied to its namespace's state, so a record's
`step` is `result.sequence` (the index in the state that applied it), never the stack's own count.
Record fields: docs/TELEMETRY.md.

The result the observers read (`StepResult`) is here, so that the stack and its observers share it
without importing each other, and so are the lines an operator reads at INFO: what each model
loaded, and one line per scored step. At startup (`log_models`), one line per model: its checkpoint, the revision it was loaded at, its
dtype, the bytes of its weights, where they are, and which attention it runs (where the scorer
chose one). The budget, placement decisions and each cost model's fit are logged by the memory
layer as they are made (`rewardstack._memory`). Per step (`OperatorLog`, a step observer of the
stack), one line: the step's name, its completions, the time it took, the count of each status and
the memory peak above what was live when it began (on CPU a watch window of the tracker: the peak
of the model calls inside the step; on CUDA the allocator's, through a nestable peak window, so the
telemetry's per-call windows inside it do not reset it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch

from rewardstack.config import StackConfig
from rewardstack._memory import MemoryManager
from rewardstack._memory.budget import weights_bytes
from rewardstack._memory.device import MemorySnapshot, PeakWindow

log = logging.getLogger("rewardstack.stack")


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


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def revision_of(path: str | Sequence[str] | None, configured: str | None, modules: list[torch.nn.Module]) -> str:
    """The revision a model was loaded at: the configured one, else the hub commit transformers
    recorded, else 'local folder(s)' when every path is on disk (relevance loads two), else the
    hub's default branch, which `rewardstack download` would lock."""
    if configured:
        return configured
    for m in modules:
        commit = getattr(getattr(m, "config", None), "_commit_hash", None)
        if commit:
            return str(commit)
    given = [path] if isinstance(path, str) else list(path or [])
    if given and all(p and Path(p).exists() for p in given):
        return "local folder" if len(given) == 1 else "local folders"
    return "the hub's default branch (not locked: rewardstack download pins it)"


def log_models(stack: ScoringStack) -> None:
    """One INFO line per loaded model: checkpoint, revision, dtype, weights bytes, device."""
    for name, scorer in stack.scorers.items():
        modules = scorer.modules()
        if not modules:
            log.info("model %s: rule-based, no weights", name)
            continue
        cfg = stack.config.models[name]
        params = [p for m in modules for p in m.parameters()]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        where = sorted({str(p.device) for p in params})
        path = cfg.path if cfg.path else ", ".join(cfg.paths)
        attention = scorer.attention_info()
        log.info("model %s: %s at %s, %s, %s of weights on %s%s", name, path,
                 revision_of(cfg.path or list(cfg.paths), cfg.revision, modules), "/".join(dtypes),
                 _mib(weights_bytes(modules)), "+".join(where), f"; {attention}" if attention else "")


class OperatorLog(StepObserver):
    """The stack's step observer that times each step, measures its memory peak and logs its line.

    Per thread: two threads scoring steps on one stack each get their own window and clock.
    """

    def __init__(self) -> None:
        self._tls = threading.local()

    def step_started(self, stack: ScoringStack, name: str) -> None:
        s = self._tls
        # watch=True: the model calls inside the step enter the tracker themselves, and their peak counts
        s.name, s.window, s.seconds = name, PeakWindow(stack.device, stack.memory.tracker, watch=True), 0.0
        s.started = time.perf_counter()
        s.window.__enter__()

    def step_ended(self, stack: ScoringStack) -> None:
        s = self._tls
        s.window.__exit__(None, None, None)
        s.seconds = time.perf_counter() - s.started

    def step_scored(self, stack: ScoringStack, result: StepResult) -> None:
        s = self._tls
        counts = Counter(result.statuses)
        statuses = ", ".join(f"{st} {n}" for st, n in sorted(counts.items())) or "no completions"
        log.info("step %d %s: %d completions in %.3fs; %s; memory peak %s", stack.steps_scored, s.name,
                 len(result.statuses), s.seconds, statuses, _mib(s.window.peak_increase))
