"""The monitor: one record per model call, per step and per placement move, attributed to the step.

`Monitor.attach(stack)` subscribes the monitor to the stack's memory manager (a `MemoryObserver`:
`MemoryManager.subscribe`) and to the stack's steps (a `StepObserver`: `RewardStack.step_observers`).
The manager hands it every forward function it runs under the OOM guard (`batch`), so each batch
the guard runs (split halves and CPU fallbacks included) gets a `call` record with its shape, the
cost model's prediction, the measured peak, the time and the outcome; every OOM reaches `oom`,
which prepares the incident record; every placement move reaches `moved`; every profile (a cost
model measured mid-run, as a tight budget asks of DPO) reaches `profiled` and becomes a
`profiling` record, its seconds counted in the step's `profiling_seconds`. At the end of each step
(`step_done`) the records of that step get its index and name and the inputs' completions (the
step's completion index of each input, as the scorer told the manager: `MemoryManager.run(completions=)`), the
monitor fills in the step's memory record and writes them (run directory), counts them
(Prometheus), feeds the alarms and keeps the summary; the stack's `on_step` callbacks (a
validator's wandb logging) then receive the same step record. Fields and units: docs/TELEMETRY.md.

Step attribution: records made between two step ends belong to the step that ends next; a caller
that runs forward passes of several steps at once (the service's batching) gets them attributed to
the first of those steps to end.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from rewardstack._memory.calibration import ProfileRecord
from rewardstack._memory.manager import MemoryObserver
from rewardstack._memory.placement import PlacementMove
from rewardstack._memory.device import PeakWindow
from rewardstack._memory.device import MemorySnapshot, take_snapshot
from rewardstack._models import USER_PREFIX, owner_of
from rewardstack._stepobservers import StepObserver, StepReport
from rewardstack._telemetry.account import card_account
from rewardstack._telemetry.alarms import Alarms
from rewardstack._telemetry.incidents import History, cuda_allocator_stats, describe_input
from rewardstack._telemetry.metrics import Metrics
from rewardstack._telemetry.rundir import RunDir

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._memory.costmodel import CostModel
    from rewardstack._memory.guard import OomRecord
    from rewardstack.stack import RewardStack

log = logging.getLogger("rewardstack.telemetry")

# The guard's action after an OOM -> the outcome of the call that ran out of memory.
OUTCOMES = {"split": "split", "cpu_fallback": "cpu_fallback", "gave_up": "oom"}
HEAD_CHARS = 80  # characters of an input in call records and the summary (incidents keep 200)
TOP_CALLS = 10


@dataclass
class _Pending:
    """An OOM seen during the step, written as an incident when the step's inputs are known."""

    record: dict[str, Any]
    snapshot: Any = None
    completions: list[int | None] | None = None
    """The step's completion index of each of the batch's inputs (None: not told)."""


@dataclass
class _StepRecords:
    """The records made since the last step ended: they belong to the step ending now."""

    calls: list[dict[str, Any]]
    moves: list[dict[str, Any]]
    profiles: list[dict[str, Any]]
    pending: list[_Pending]


def _text(completions: list[str | None], comp: int | None) -> str | None:
    """Completion `comp`'s text; None: the prompt, or an input nobody named."""
    return completions[comp] if comp is not None and 0 <= comp < len(completions) else None


LOOSE_CHUNK = 256
"""Trainer-route call records written to the timeline together (so a trainer-only service's
records reach the run directory without holding memory for a step that never comes)."""


class Monitor(MemoryObserver, StepObserver):
    """Records model calls, steps, placement moves and OOMs; see the module docstring."""

    wants_records = True

    def __init__(
        self,
        *,
        device: torch.device | str = "cpu",
        tracker: Any = None,
        budget_bytes: int | None = None,
        run_dir: RunDir | None = None,
        metrics: Metrics | None = None,
        alarms: Alarms | None = None,
        history_entries: int = 0,
        summary_every: int = 10,
    ) -> None:
        self.device = torch.device(device)
        self.tracker = tracker
        self.budget_bytes = budget_bytes
        self.run_dir = run_dir
        self.metrics = metrics
        self.alarms = alarms if alarms is not None else Alarms()
        self.history = History(self.device, history_entries)
        self.summary_every = summary_every
        self.started = time.time()
        self._lock = threading.Lock()
        self._calls: list[dict[str, Any]] = []
        # Call records of the trainer routes' models (`rewards.<name>`): never part of a validator
        # step, so never held for one; written in chunks (`LOOSE_CHUNK`) with no step.
        self._loose: list[dict[str, Any]] = []
        self._moves: list[dict[str, Any]] = []
        self._profiles: list[dict[str, Any]] = []
        self._pending: list[_Pending] = []
        self._fallback_next: set[tuple[str, tuple[int, ...]]] = set()
        # Per run name, the step's completion index of each input of its latest run (an OOM record
        # carries only the scorer's own indices).
        self._labels: dict[str, list[int | None] | None] = {}
        self._stack: Any = None
        self._memory: Any = None
        self._last_retries: int | None = None
        # What the summary keeps (bounded: aggregates and the top calls, never every record).
        self.steps = 0
        self.models: dict[str, dict[str, Any]] = {}
        self.statuses: Counter[str] = Counter()
        self.top: list[tuple[int, int, dict[str, Any]]] = []  # min-heap of (peak, seq, call)
        self._seq = 0
        self.incident_files: list[str] = []
        self.incidents = 0
        self.swaps = 0
        self.profiling = {"count": 0, "seconds": 0.0}
        self.last_rest: dict[str, Any] | None = None
        self.closed = False

    # -- wiring -----------------------------------------------------------------------------
    @classmethod
    def attach(cls, stack: "RewardStack", **kwargs: Any) -> "Monitor":
        """A monitor observing `stack` (its memory manager and its steps); kwargs as `Monitor`."""
        mem = stack.memory
        kwargs.setdefault("device", mem.device)
        kwargs.setdefault("tracker", mem.tracker)
        kwargs.setdefault("budget_bytes", mem.budget_bytes)
        m = cls(**kwargs)
        m._stack, m._memory = stack, mem
        mem.subscribe(m)
        stack.step_observers.append(m)
        m._start_record(stack)
        return m

    def detach(self) -> None:
        """Stop observing the stack (records already made stay)."""
        if self._memory is not None:
            self._memory.unsubscribe(self)
        if self._stack is not None and self in self._stack.step_observers:
            self._stack.step_observers.remove(self)
        self.history.stop()

    def _start_record(self, stack: Any) -> None:
        snap = take_snapshot(self.device, self.tracker)
        budget = getattr(stack.memory, "budget", None)
        rec = {"type": "start", "time": self.started, "device": str(self.device), "source": snap.source,
               "budget_bytes": self.budget_bytes, "budget": budget.__dict__ if budget is not None else None,
               "budget_line_bytes": self.budget_line(snap), "rest": snap.to_dict(),
               "cost_models": {n: c.to_dict() for n, c in stack.memory.cost_models.items()},
               "models": sorted(getattr(stack, "scorers", {}))}
        if self.run_dir is not None:
            self.run_dir.timeline(rec)
            self.run_dir.flush()

    def budget_line(self, snap: MemorySnapshot) -> int | None:
        """Where the budget sits on the memory axis: the activation budget above what is live at rest."""
        if self.budget_bytes is None:
            return None
        # On the simulated device only activations are counted; on CUDA the weights are allocated too.
        return self.budget_bytes + ((snap.allocated or 0) if snap.source == "cuda" else 0)

    def _move(self, model: str, direction: str, nbytes: int, seconds: float | None, t0: float) -> None:
        rec = {"type": "placement", "model": model, "direction": direction, "bytes": int(nbytes),
               "seconds": seconds, "time": t0}
        with self._lock:
            self._moves.append(rec)
        if direction == "in":
            self.swaps += 1
            if self.metrics is not None:
                self.metrics.swaps.labels(model=model).inc()

    # -- the memory manager's observer --------------------------------------------------------
    def moved(self, move: PlacementMove) -> None:
        """A placement move: one `placement` record, attributed to the step it happens in."""
        self._move(move.model, move.direction, move.bytes, move.seconds, move.time)

    def profiled(self, record: ProfileRecord) -> None:
        """A profile ran: one `profiling` record, attributed to the step it happens in."""
        rec = {"type": "profiling", "name": record.name, "model": record.model, "time": record.time,
               "seconds": record.seconds, "shapes": record.shapes}
        with self._lock:
            self._profiles.append(rec)

    def batch(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Callable[[list[int]], Sequence[Any]],
        cost: "CostModel",
        on_host: bool = False,
        prefix: int = 0,
        completions: Sequence[int | None] | None = None,
    ) -> Callable[[list[int]], Sequence[Any]]:
        """`forward`, recording one `call` record per batch it runs (the manager's hook)."""
        lengths = [int(x) for x in lengths]
        n_inputs = len(lengths)
        labels = list(completions) if completions is not None else None
        self._labels[name] = labels

        def observed(idx: list[int]) -> Sequence[Any]:
            key = (name, tuple(idx))
            fallback = key in self._fallback_next
            if fallback:
                self._fallback_next.discard(key)
            b = len(idx)
            length = max(lengths[i] for i in idx) if idx else 0
            window = PeakWindow(self.device, self.tracker)
            outcome = "error"
            t0, p0 = time.time(), time.perf_counter()
            try:
                with window:
                    values = forward(idx)
                outcome = "ok"
                return values
            except torch.OutOfMemoryError:
                outcome = "oom"  # `oom` replaces it with what the guard did next
                raise
            finally:
                seconds = time.perf_counter() - p0
                predicted = int(cost.predict(b, length, prefix)) if b else 0
                peak = window.peak_increase
                self._add_call({
                    "type": "call", "model": name, "time": t0, "seconds": seconds, "batch": b,
                    "padded_length": length, "padded_tokens": b * length, "lengths": [lengths[i] for i in idx],
                    "inputs": list(idx), "completions": [labels[i] for i in idx] if labels is not None else None,
                    "n_inputs": n_inputs, "predicted_bytes": predicted, "prefix_tokens": int(prefix),
                    "peak_bytes": peak, "start_bytes": window.start,
                    "error_ratio": (peak - predicted) / predicted if peak is not None and predicted > 0 and outcome == "ok" else None,
                    "outcome": outcome, "on_host": bool(on_host or fallback or peak is None), "fallback": fallback,
                    "injected": False,
                })

        return observed

    def _add_call(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if not str(rec["model"]).startswith(USER_PREFIX):
                self._calls.append(rec)
                return
            self._loose.append(rec)
            if len(self._loose) < LOOSE_CHUNK:
                return
            loose, self._loose = self._loose, []
        self._write_without_step(loose)

    def _write_without_step(self, records: list[dict[str, Any]]) -> None:
        if self.run_dir is not None and records:
            for rec in records:
                self.run_dir.timeline({**rec, "step": None})
            self.run_dir.flush()

    def oom(self, rec: "OomRecord") -> None:
        """An OOM the guard handled: settle the call's outcome and prepare the incident record."""
        outcome = OUTCOMES.get(rec.action, rec.action)
        labels = self._labels.get(rec.model)
        named = [labels[i] for i in rec.indices] if labels is not None and max(rec.indices, default=-1) < len(labels) else None
        call = None
        with self._lock:
            for c in reversed(self._calls):
                if c["model"] == rec.model and c["inputs"] == rec.indices:
                    # The latest attempt at this batch, unless it is settled already (then the OOM
                    # struck before a pass ran). An injected OOM may strike as the pass returns.
                    if c["outcome"] == "oom" or (rec.injected and c["outcome"] == "ok"):
                        call = c
                    break
        if call is not None:
            call["outcome"] = outcome
            call["error_ratio"] = None  # the pass did not complete: no prediction to judge
        else:  # injected before the forward ran: no call record yet
            call = {"type": "call", "model": rec.model, "time": rec.time, "seconds": 0.0, "batch": rec.batch,
                    "padded_length": rec.length, "padded_tokens": rec.batch * rec.length, "lengths": list(rec.lengths),
                    "inputs": list(rec.indices), "completions": named, "n_inputs": None, "predicted_bytes": None, "peak_bytes": None,
                    "start_bytes": None, "error_ratio": None, "outcome": outcome, "on_host": False,
                    "fallback": False, "injected": True}
            self._add_call(call)
        call["injected"] = bool(rec.injected)
        if rec.action == "cpu_fallback":
            self._fallback_next.add((rec.model, tuple(rec.indices)))
        if self.metrics is not None:
            (self.metrics.ooms_lost if rec.action == "gave_up" else self.metrics.ooms_recovered).labels(model=owner_of(rec.model)).inc()
        snap = take_snapshot(self.device, self.tracker)
        incident: dict[str, Any] = {
            "type": "incident", "time": rec.time, "model": rec.model, "message": rec.message,
            "action": rec.action, "outcome": outcome, "injected": rec.injected, "batch": rec.batch,
            "padded_length": rec.length, "lengths": list(rec.lengths), "indices": list(rec.indices),
            "predicted_bytes": call.get("predicted_bytes"), "budget_bytes": self.budget_bytes,
            "cost_model": self._cost_dict(rec.model), "memory": snap.to_dict(),
        }
        if self.tracker is not None:
            report = self.tracker.last_oom if not rec.injected else None
            if report is None:  # injected: what is live where the pass would have allocated
                report = {"live_bytes": self.tracker.live_bytes, "largest": self.tracker.largest_live()}
            incident["largest_tensors"] = report.get("largest", [])
            incident["tracker"] = {k: v for k, v in report.items() if k != "largest"}
        elif self.device.type == "cuda":  # pragma: no cover - CUDA-only path
            incident["allocator"] = cuda_allocator_stats(self.device)
        with self._lock:
            self._pending.append(_Pending(incident, self.history.capture(), named))

    def _cost_dict(self, model: str) -> dict[str, Any] | None:
        cm = getattr(self._memory, "cost_models", {}).get(model) if self._memory is not None else None
        return None if cm is None else cm.to_dict(samples=False)

    # -- steps ------------------------------------------------------------------------------
    def step_done(self, report: StepReport) -> None:
        """Close the step: attribute its records to it, fill in its record, then write, count, alarm."""
        stack, result, record = report.stack, report.result, report.record
        event = result.event
        # The step's index in the state that applied it (`step_record`): in the service, its
        # namespace's; the stack's own count never moves there.
        index = int(record.get("step", self.steps + 1))
        completions: list[str | None] = event.get("completions", [])
        with self._lock:
            recs = _StepRecords(self._calls, self._moves, self._profiles, self._pending)
            self._calls, self._moves, self._profiles, self._pending = [], [], [], []
        models = self._attribute(recs, index, event.get("name"), completions)
        mem = getattr(stack, "memory", None)
        same = mem is not None and self.device == mem.device and self.tracker is mem.tracker
        snap = report.snapshot if same else take_snapshot(self.device, self.tracker)
        calls, profiles = recs.calls, recs.profiles
        peaks = [c["start_bytes"] + c["peak_bytes"] for c in calls if c["peak_bytes"] is not None and c["start_bytes"] is not None]
        record.update({
            "step": index, "completions": len(completions), "models": models, "calls": len(calls),
            "ooms": sum(m["ooms"] for m in models.values()), "peak_bytes": max(peaks) if peaks else None,
            "rest": snap.to_dict(), "budget_bytes": self.budget_bytes, "budget_line_bytes": self.budget_line(snap),
            # Time spent profiling inside the step (outside every model call): its own band in the report.
            "profiling_seconds": sum(pr["seconds"] for pr in profiles), "profiles": len(profiles),
        })
        if self._memory is not None:  # the card's whole account (telemetry/account.py)
            record["card"] = card_account(self._memory, snap, max((m["peak_bytes"] or 0 for m in models.values()), default=None))
        self.steps += 1
        # Memory at rest is the process's: its trend is over the steps this process scored, one
        # series for all namespaces (their own indices repeat and interleave in the service).
        trends = self.alarms.observe(self.steps, snap, record["declared"])
        for t in trends:
            log.warning("%s", t.describe())
            record["alarms"].append(t.series)
            if self.metrics is not None:
                self.metrics.alarms.labels(series=t.series).inc()
        self._write(recs, trends, record, result)
        self._aggregate(record, calls)
        if self.metrics is not None:
            self._count(record, calls, snap, result)
        if self.run_dir is not None and self.steps % self.summary_every == 0:
            self.run_dir.write_summary(self.summary())

    def _attribute(self, recs: _StepRecords, index: int, name: Any, completions: list[str | None]) -> dict[str, Any]:
        """Give the step's records its index and name (inputs: their completions); returns its calls per model."""
        models: dict[str, dict[str, Any]] = {}
        for c in recs.calls:
            c["step"], c["step_name"] = index, name
            if c["inputs"]:
                j = max(range(len(c["inputs"])), key=lambda k: c["lengths"][k])
                comp = c["completions"][j] if c["completions"] is not None else None
                t = _text(completions, comp)
                c["longest"] = {"input": c["inputs"][j], "completion": comp, "length": c["lengths"][j],
                                "head": t[:HEAD_CHARS] if t is not None else None}
            m = models.setdefault(owner_of(c["model"]), {"calls": 0, "seconds": 0.0, "peak_bytes": None,
                                                       "predicted_bytes": None, "ooms": 0})
            m["calls"] += 1
            m["seconds"] += c["seconds"]
            if c["peak_bytes"] is not None:
                m["peak_bytes"] = max(m["peak_bytes"] or 0, c["peak_bytes"])
            if c["predicted_bytes"] is not None:
                m["predicted_bytes"] = max(m["predicted_bytes"] or 0, c["predicted_bytes"])
            m["ooms"] += c["outcome"] in ("split", "cpu_fallback", "oom")
        for m in recs.moves:
            m["step"], m["step_name"] = index, name
        for pr in recs.profiles:
            pr["step"], pr["step_name"] = index, name
            self.profiling["count"] += 1
            self.profiling["seconds"] += pr["seconds"]
        for p in recs.pending:
            p.record["step"], p.record["step_name"] = index, name
            comps = p.completions or [None] * len(p.record["indices"])
            p.record["inputs"] = [describe_input(i, length, comp, _text(completions, comp))
                                  for i, length, comp in zip(p.record["indices"], p.record["lengths"], comps)]
        return models

    def _write(self, recs: _StepRecords, trends: list[Any], record: dict[str, Any], result: Any) -> None:
        """Write the step's incidents (counted), then its records to the timeline and its event (run directory)."""
        rd = self.run_dir
        for p in recs.pending:
            self.incidents += 1
            if rd is not None:
                path = rd.incident(p.record, snapshot=History.writer(p.snapshot))
                p.record["file"] = path.name
                self.incident_files.append(path.name)
                del self.incident_files[:-100]
            if self.metrics is not None:
                self.metrics.incidents.inc()
        if rd is not None:
            for c in recs.calls:
                rd.timeline(c)
            for m in recs.moves:
                rd.timeline(m)
            for pr in recs.profiles:
                rd.timeline(pr)
            for p in recs.pending:
                rd.timeline({"type": "oom", "step": p.record["step"], "model": p.record["model"],
                             "time": p.record["time"], "action": p.record["action"], "file": p.record.get("file"),
                             "inputs": [i.get("completion") for i in p.record["inputs"]]})
            for t in trends:
                rd.timeline({"type": "alarm", "step": record["step"], "time": record["time"], "message": t.describe(), **t.to_dict()})
            rd.timeline(record)
            rd.event(result.event)
            rd.flush()

    def _aggregate(self, record: dict[str, Any], calls: list[dict[str, Any]]) -> None:
        self.last_rest = record["rest"]
        self.statuses.update(record["statuses"])
        for c in calls:
            m = self.models.setdefault(owner_of(c["model"]), {
                "calls": 0, "seconds": 0.0, "peak_bytes": 0, "ooms_recovered": 0, "ooms_lost": 0,
                "errors": 0, "abs_error_sum": 0.0, "max_abs_error": 0.0})
            m["calls"] += 1
            m["seconds"] += c["seconds"]
            if c["peak_bytes"] is not None:
                m["peak_bytes"] = max(m["peak_bytes"], c["peak_bytes"])
            if c["outcome"] in ("split", "cpu_fallback"):
                m["ooms_recovered"] += 1
            elif c["outcome"] == "oom":
                m["ooms_lost"] += 1
            if c["error_ratio"] is not None:
                m["errors"] += 1
                m["abs_error_sum"] += abs(c["error_ratio"])
                m["max_abs_error"] = max(m["max_abs_error"], abs(c["error_ratio"]))
            if c["peak_bytes"]:
                self._seq += 1
                item = (c["peak_bytes"], self._seq, {k: c.get(k) for k in (
                    "step", "step_name", "model", "batch", "padded_length", "peak_bytes", "predicted_bytes", "outcome", "longest",
                    "completions")})
                if len(self.top) < TOP_CALLS:
                    heapq.heappush(self.top, item)
                elif item[0] > self.top[0][0]:
                    heapq.heapreplace(self.top, item)

    def _count(self, record: dict[str, Any], calls: list[dict[str, Any]], snap: MemorySnapshot, result: Any) -> None:
        mt = self.metrics
        assert mt is not None
        mt.steps.inc()
        if record["seconds"] is not None:
            mt.step_seconds.observe(record["seconds"])
        mt.observe_snapshot(snap, self.budget_bytes)
        if snap.num_alloc_retries is not None:
            if self._last_retries is not None and snap.num_alloc_retries > self._last_retries:
                mt.alloc_retries.inc(snap.num_alloc_retries - self._last_retries)
            self._last_retries = snap.num_alloc_retries
        for c in calls:
            model = owner_of(c["model"])
            mt.call_seconds.labels(model=model).observe(c["seconds"])
            if c["peak_bytes"] is not None:
                mt.call_peak.labels(model=model).observe(c["peak_bytes"])
            if c["error_ratio"] is not None:
                mt.cost_error.labels(model=model).observe(c["error_ratio"])
        for model, statuses in result.model_statuses.items():
            for status, n in Counter(statuses).items():
                mt.completions.labels(model=model, status=status).inc(n)

    # -- the run at a glance ----------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The run so far: per-model peaks, OOMs and cost-model error, the top calls, the alarms."""
        models = {}
        for name, m in sorted(self.models.items()):
            models[name] = {
                "calls": m["calls"], "seconds": m["seconds"], "peak_bytes": m["peak_bytes"],
                "ooms_recovered": m["ooms_recovered"], "ooms_lost": m["ooms_lost"],
                "cost_model_mean_abs_error": m["abs_error_sum"] / m["errors"] if m["errors"] else None,
                "cost_model_max_abs_error": m["max_abs_error"] if m["errors"] else None,
            }
        return {
            "started": self.started, "updated": time.time(), "device": str(self.device),
            "budget_bytes": self.budget_bytes, "steps": self.steps, "completions": dict(self.statuses),
            "models": models, "top_calls": [c for _, _, c in sorted(self.top, key=lambda t: (-t[0], t[1]))],
            "ooms": sum(m["ooms_recovered"] + m["ooms_lost"] for m in self.models.values()),
            "incidents": self.incidents, "incident_files": list(self.incident_files),
            "swaps": self.swaps, "alarms": self.alarms.verdict(), "rest": self.last_rest,
            "profiling": dict(self.profiling),
        }

    def close(self) -> None:
        """Write what is pending and the summary, close the run directory, stop observing."""
        if self.closed:
            return
        self.closed = True
        self.detach()
        if self.run_dir is not None:
            with self._lock:
                calls, self._calls = self._calls, []
                loose, self._loose = self._loose, []
                profiles, self._profiles = self._profiles, []
                pending, self._pending = self._pending, []
            # Trainer calls, the forward passes and profiles of a step that never ended (an interrupted run).
            self._write_without_step(loose + calls + profiles)
            for p in pending:
                p.record.setdefault("step", None)
                comps = p.completions or [None] * len(p.record["indices"])
                p.record.setdefault("inputs", [describe_input(i, n, comp, None)
                                                for i, n, comp in zip(p.record["indices"], p.record["lengths"], comps)])
                self.run_dir.incident(p.record, snapshot=History.writer(p.snapshot))
            self.run_dir.timeline({"type": "end", "time": time.time(), "steps": self.steps})
            self.run_dir.write_summary(self.summary())
            self.run_dir.close()
