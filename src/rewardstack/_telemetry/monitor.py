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

OOM incident records say afterwards why an out-of-memory error happened: one record per OOM,
recovered or not: the step, the model, the batch's shape and token lengths, the cost model's
prediction and the budget, the allocator's figures, and every input of the batch by its index,
length, first 200 characters and sha256 (so the input can be found again in the events without
copying it whole). On CPU the record lists the largest live tensors the tracker saw at the failing
allocation, with the aten op that made each. On CUDA the allocator's allocation history is recorded
with a bounded number of entries (`History`), and at each OOM its snapshot is written beside the
record as a pickle for PyTorch's memory visualizer (pytorch.org/memory_viz, or `python -m
torch.cuda._memory_viz`). rewardstack writes that file for the visualizer and never reads one.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from rewardstack._memory.calibration import ProfileRecord
from rewardstack._memory.manager import MemoryObserver
from rewardstack._memory.placement import PlacementMove
from rewardstack._memory.device import PeakWindow
from rewardstack._memory.device import MemorySnapshot, take_snapshot
from rewardstack._models import USER_PREFIX, owner_of
from rewardstack._stepobservers import StepObserver, StepReport
from rewardstack._telemetry.alarms import Alarms
from rewardstack._telemetry.metrics import Metrics
from rewardstack._telemetry.rundir import ON_CARD, RunDir

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._memory.costmodel import CostModel
    from rewardstack._memory.guard import OomRecord
    from rewardstack.stack import RewardStack

log = logging.getLogger("rewardstack.telemetry")

HEAD_CHARS = 80  # characters of an input in call records and the summary
INCIDENT_HEAD_CHARS = 200  # characters of an input in an incident record
TOP_CALLS = 10
TOP_KEYS = ("step", "step_name", "model", "batch", "padded_length", "peak_bytes", "predicted_bytes", "outcome",
            "longest", "completions")
KINDS = ("call", "placement", "profiling")
"""The records a step holds, in the order the timeline gets them (docs/TELEMETRY.md)."""
SUMMARY_EVERY = 10
"""summary.json is rewritten every this many steps (and at the end)."""
LOOSE_CHUNK = 256
"""Trainer-route call records written to the timeline together (so a trainer-only service's
records reach the run directory without holding memory for a step that never comes)."""


def _text(completions: list[str | None], comp: int | None) -> str | None:
    """Completion `comp`'s text; None: the prompt, or an input nobody named."""
    return completions[comp] if comp is not None and 0 <= comp < len(completions) else None


def _describe_inputs(incident: dict[str, Any], named: list[int | None] | None, completions: list[str | None]) -> None:
    """The incident's `inputs`: each input of the batch by its index in the scorer's call, its completion
    and tokens, and where its text is known, its head, length and hash."""
    inputs = []
    for i, n, comp in zip(incident["indices"], incident["lengths"], named or [None] * len(incident["indices"])):
        d: dict[str, Any] = {"index": i, "length": n, "completion": comp}
        text = _text(completions, comp)
        if text is not None:
            d.update(head=text[:INCIDENT_HEAD_CHARS], chars=len(text),
                     sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
        inputs.append(d)
    incident["inputs"] = inputs


def _call_record(model: str, t0: float, lengths: list[int], inputs: list[int], completions: list[int | None] | None,
                 **fields: Any) -> dict[str, Any]:
    """A `call` record of one batch (`fields` fill in what was measured; the rest is unmeasured)."""
    b, length = len(inputs), max(lengths, default=0)
    return {"type": "call", "model": model, "time": t0, "seconds": 0.0, "batch": b, "padded_length": length,
            "padded_tokens": b * length, "lengths": lengths, "inputs": inputs, "completions": completions,
            "n_inputs": None, "predicted_bytes": None, "prefix_tokens": None, "peak_bytes": None, "start_bytes": None,
            "error_ratio": None, "on_host": False, "fallback": False, "injected": False, **fields}


class History:
    """CUDA allocation history, recorded with at most `max_entries` entries (never unbounded).

    `capture()` takes the allocator's snapshot (segments and the recent alloc/free trace, the OOM
    included) at the moment of an OOM; the run directory pickles it beside the incident for the
    memory visualizer. Off (0 entries) or not on CUDA: nothing is recorded and nothing is written.
    """

    def __init__(self, device: torch.device, max_entries: int) -> None:
        self.device = device
        self.max_entries = max(0, int(max_entries))
        self.on = False
        if self.max_entries and device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - CUDA-only path
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, device=device)
            self.on = True
            log.info("recording CUDA allocation history (at most %d entries)", self.max_entries)

    def capture(self) -> Any | None:
        """The allocator's snapshot now (None when not recording)."""
        if not self.on:
            return None
        try:  # pragma: no cover - CUDA-only path
            return torch.cuda.memory._snapshot(self.device)
        except Exception as e:  # noqa: BLE001 - forensics must never stop scoring
            log.warning("could not take the allocator snapshot: %s", e)
            return None

    def stop(self) -> None:
        """Stop recording."""
        if self.on:  # pragma: no cover - CUDA-only path
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.on = False


def card_account(memory: Any, snap: MemorySnapshot, activation_peak: int | None) -> dict[str, Any]:
    """The card's whole account now, as the step record's `card` entry (bytes; None: not measured).

    The weights of every model by where they are (resident on the card, swapped in for this step,
    on the host), each loaded checkpoint counted once where models share it (`counted_bytes`,
    `shared_with`: the stand-ins' diversity mask loads relevance's second model, counted for
    relevance), the step's activation peak (the largest call's peak above what was live when it
    began), the allocator's reserved and allocated bytes (their difference is fragmentation), the
    headroom kept free, the activation budget and the card's size. On CPU the card is the simulated
    device (the tensor-bytes tracker): no cache, so reserved equals allocated, and its size is the
    budget the weights were placed into. The report draws these records.
    """
    placement = memory.placement.summary() if memory.placement is not None else {}
    swapped_in = set(placement.get("swapped_in", []))
    weights: dict[str, dict[str, Any]] = {}
    for name, d in (placement.get("models") or {}).items():
        where = d["where"]
        state = "resident" if where == "resident" else "swapped_in" if (where == "swap" and name in swapped_in) \
            else "swapped_out" if where == "swap" else "host"
        # `bytes`: the model's whole size; `counted_bytes`: what it adds to the stack's weights
        # (placement counts a module shared by several models once, for one of them).
        weights[name] = {"state": state, "bytes": int(d["bytes"]), "counted_bytes": int(d.get("counted_bytes", d["bytes"])),
                         "shared_with": list(d.get("shared_with", []))}
    budget = memory.budget
    return {
        "source": snap.source,
        "weights": weights,
        "weights_on_card": sum(w["counted_bytes"] for w in weights.values() if w["state"] in ON_CARD),
        "weights_host": sum(w["counted_bytes"] for w in weights.values() if w["state"] not in ON_CARD),
        "activation_peak": activation_peak,
        "allocated": snap.allocated,
        "reserved": snap.reserved,
        "fragmentation": snap.fragmentation,
        "headroom": getattr(budget, "headroom_bytes", None),
        "activation_budget": memory.budget_bytes,
        # The card's size: None on CPU without device_memory, where memory_budget is both the weight
        # budget placement packs into and, separately, the activation budget (weights are not charged).
        "capacity": getattr(budget, "total_bytes", None),
        "weight_budget": placement.get("budget_bytes"),
        "swaps": placement.get("swaps"),
    }


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
    ) -> None:
        self.device = torch.device(device)
        self.tracker = tracker
        self.budget_bytes = budget_bytes
        self.run_dir = run_dir
        self.metrics = metrics
        self.alarms = alarms if alarms is not None else Alarms()
        self.history = History(self.device, history_entries)
        self.started = time.time()
        self._lock = threading.Lock()
        # The call, placement and profiling records made since the last step ended (they belong to
        # the step ending next), and its OOMs as (incident, allocator snapshot, the step's completion
        # index of each input), written as incidents once the step's inputs are known.
        self._records: list[dict[str, Any]] = []
        self._pending: list[tuple[dict[str, Any], Any, list[int | None] | None]] = []
        # Call records of the trainer routes' models (`rewards.<name>`): never part of a validator
        # step, so never held for one; written in chunks (`LOOSE_CHUNK`) with no step.
        self._loose: list[dict[str, Any]] = []
        self._fallback_next: set[tuple[str, tuple[int, ...]]] = set()
        # Per run name, the step's completion index of each input of its latest run (an OOM record
        # carries only the scorer's own indices).
        self._labels: dict[str, list[int | None] | None] = {}
        self._stack: Any = None
        self._memory: Any = None
        self._last_retries: int | None = None
        # What the summary keeps (bounded: aggregates and the top calls, never every record).
        self.steps = 0
        self.models: dict[str, Counter[str]] = {}
        self.statuses: Counter[str] = Counter()
        self.top: list[dict[str, Any]] = []
        self.incident_files: list[str] = []
        self.incidents = 0
        self.swaps = 0
        self.profiling = {"count": 0, "seconds": 0.0}
        self.last_rest: dict[str, Any] | None = None
        self.closed = False

    # -- wiring -----------------------------------------------------------------------------
    @classmethod
    def attach(cls, stack: "RewardStack", **kwargs: Any) -> "Monitor":
        """A monitor observing `stack` (its memory manager and its steps), measuring on its memory's
        device and tracker against its budget; kwargs as `Monitor` (the rest)."""
        mem = stack.memory
        m = cls(device=mem.device, tracker=mem.tracker, budget_bytes=mem.budget_bytes, **kwargs)
        m._stack, m._memory = stack, mem
        mem.subscribe(m)
        stack.step_observers.append(m)
        if m.run_dir is not None:
            snap = take_snapshot(m.device, m.tracker)
            m.run_dir.timeline({
                "type": "start", "time": m.started, "device": str(m.device), "source": snap.source,
                "budget_bytes": m.budget_bytes, "budget": mem.budget.__dict__ if mem.budget is not None else None,
                "budget_line_bytes": m.budget_line(snap), "rest": snap.to_dict(),
                "cost_models": {n: c.to_dict() for n, c in mem.cost_models.items()},
                "models": sorted(stack.scorers)})
            m.run_dir.flush()
        return m

    def budget_line(self, snap: MemorySnapshot) -> int | None:
        """Where the budget sits on the memory axis: the activation budget above what is live at rest."""
        if self.budget_bytes is None:
            return None
        # On the simulated device only activations are counted; on CUDA the weights are allocated too.
        return self.budget_bytes + ((snap.allocated or 0) if snap.source == "cuda" else 0)

    # -- the memory manager's observer --------------------------------------------------------
    def moved(self, move: PlacementMove) -> None:
        """A placement move: one `placement` record, attributed to the step it happens in."""
        with self._lock:
            self._records.append({"type": "placement", "model": move.model, "direction": move.direction,
                                  "bytes": int(move.bytes), "seconds": move.seconds, "time": move.time})
        if move.direction == "in":
            self.swaps += 1
            if self.metrics is not None:
                self.metrics.swaps.labels(model=move.model).inc()

    def profiled(self, record: ProfileRecord) -> None:
        """A profile ran: one `profiling` record, attributed to the step it happens in."""
        with self._lock:
            self._records.append({"type": "profiling", "name": record.name, "model": record.model, "time": record.time,
                                  "seconds": record.seconds, "shapes": record.shapes})

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
        labels = list(completions) if completions is not None else None
        self._labels[name] = labels

        def observed(idx: list[int]) -> Sequence[Any]:
            key = (name, tuple(idx))
            fallback = key in self._fallback_next
            self._fallback_next.discard(key)
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
                sub = [lengths[i] for i in idx]
                predicted = int(cost.predict(len(idx), max(sub), prefix)) if idx else 0
                peak = window.peak_increase
                ok = peak is not None and predicted > 0 and outcome == "ok"
                self._add_call(_call_record(
                    name, t0, sub, list(idx), [labels[i] for i in idx] if labels is not None else None,
                    seconds=time.perf_counter() - p0, n_inputs=len(lengths), predicted_bytes=predicted,
                    prefix_tokens=int(prefix), peak_bytes=peak, start_bytes=window.start,
                    error_ratio=(peak - predicted) / predicted if ok else None, outcome=outcome,
                    on_host=bool(on_host or fallback or peak is None), fallback=fallback))

        return observed

    def _add_call(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if not str(rec["model"]).startswith(USER_PREFIX):
                self._records.append(rec)
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
        outcome = "oom" if rec.action == "gave_up" else rec.action  # split and cpu_fallback keep their name
        labels = self._labels.get(rec.model)
        named = [labels[i] for i in rec.indices] if labels is not None and max(rec.indices, default=-1) < len(labels) else None
        call = None
        with self._lock:
            for c in reversed(self._records):
                if c["type"] == "call" and c["model"] == rec.model and c["inputs"] == rec.indices:
                    # The latest attempt at this batch, unless it is settled already (then the OOM
                    # struck before a pass ran). An injected OOM may strike as the pass returns.
                    if c["outcome"] == "oom" or (rec.injected and c["outcome"] == "ok"):
                        call = c
                    break
        if call is not None:
            call["outcome"] = outcome
            call["error_ratio"] = None  # the pass did not complete: no prediction to judge
        else:  # injected before the forward ran: no call record yet
            call = _call_record(rec.model, rec.time, list(rec.lengths), list(rec.indices), named, outcome=outcome)
            self._add_call(call)
        call["injected"] = bool(rec.injected)
        if rec.action == "cpu_fallback":
            self._fallback_next.add((rec.model, tuple(rec.indices)))
        if self.metrics is not None:
            (self.metrics.ooms_lost if rec.action == "gave_up" else self.metrics.ooms_recovered).labels(model=owner_of(rec.model)).inc()
        cm = getattr(self._memory, "cost_models", {}).get(rec.model)
        incident: dict[str, Any] = {
            "type": "incident", "time": rec.time, "model": rec.model, "message": rec.message,
            "action": rec.action, "outcome": outcome, "injected": rec.injected, "batch": rec.batch,
            "padded_length": rec.length, "lengths": list(rec.lengths), "indices": list(rec.indices),
            "predicted_bytes": call["predicted_bytes"], "budget_bytes": self.budget_bytes,
            "cost_model": None if cm is None else cm.to_dict(samples=False),
            "memory": take_snapshot(self.device, self.tracker).to_dict(),
        }
        if self.tracker is not None:
            report = self.tracker.last_oom if not rec.injected else None
            if report is None:  # injected: what is live where the pass would have allocated
                report = {"live_bytes": self.tracker.live_bytes, "largest": self.tracker.largest_live()}
            incident["largest_tensors"] = report.get("largest", [])
            incident["tracker"] = {k: v for k, v in report.items() if k != "largest"}
        elif self.device.type == "cuda":  # pragma: no cover - CUDA-only path
            # The allocator counters the OOM is read against.
            stats = torch.cuda.memory_stats(self.device)
            keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                    "reserved_bytes.all.peak", "active_bytes.all.current", "inactive_split_bytes.all.current",
                    "requested_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_ooms")
            incident["allocator"] = {k: int(stats[k]) for k in keys if k in stats}
        with self._lock:
            self._pending.append((incident, self.history.capture(), named))

    # -- steps ------------------------------------------------------------------------------
    def step_done(self, report: StepReport) -> None:
        """Close the step: attribute its records to it, fill in its record, then write, count, alarm."""
        result, record = report.result, report.record
        event = result.event
        # The step's index in the state that applied it (`step_record`): in the service, its
        # namespace's; the stack's own count never moves there.
        index = int(record.get("step", self.steps + 1))
        completions: list[str | None] = event.get("completions", [])
        with self._lock:
            recs, self._records = self._records, []
            pending, self._pending = self._pending, []
        recs.sort(key=lambda r: KINDS.index(r["type"]))
        models: dict[str, dict[str, Any]] = {}
        for r in recs:
            r["step"], r["step_name"] = index, event.get("name")
            if r["type"] == "call":
                self._take_call(r, completions, models)
        for incident, _, named in pending:
            incident["step"], incident["step_name"] = index, event.get("name")
            _describe_inputs(incident, named, completions)
        calls = [r for r in recs if r["type"] == "call"]
        profiles = [r["seconds"] for r in recs if r["type"] == "profiling"]
        self.profiling["count"] += len(profiles)
        self.profiling["seconds"] += sum(profiles)
        snap = report.snapshot  # the stack's memory's device and tracker: `attach` gave the monitor the same
        peaks = [c["start_bytes"] + c["peak_bytes"] for c in calls if c["peak_bytes"] is not None and c["start_bytes"] is not None]
        record.update({
            "step": index, "completions": len(completions), "models": models, "calls": len(calls),
            "ooms": sum(m["ooms"] for m in models.values()), "peak_bytes": max(peaks) if peaks else None,
            "rest": snap.to_dict(), "budget_bytes": self.budget_bytes, "budget_line_bytes": self.budget_line(snap),
            # Time spent profiling inside the step (outside every model call): its own band in the report.
            "profiling_seconds": sum(profiles), "profiles": len(profiles),
        })
        if self._memory is not None:
            record["card"] = card_account(self._memory, snap, max((m["peak_bytes"] or 0 for m in models.values()), default=None))
        self.steps += 1
        self.last_rest = record["rest"]
        self.statuses.update(record["statuses"])
        self.incidents += len(pending)
        # Memory at rest is the process's: its trend is over the steps this process scored, one
        # series for all namespaces (their own indices repeat and interleave in the service).
        trends = self.alarms.observe(self.steps, snap, record["declared"])
        for t in trends:
            log.warning("%s", t.describe())
            record["alarms"].append(t.series)
        if self.run_dir is not None:
            self._write(self.run_dir, recs, pending, trends, record, result)
        if self.metrics is not None:
            self._count(self.metrics, len(pending), trends, record, snap, result)
        if self.run_dir is not None and self.steps % SUMMARY_EVERY == 0:
            self.run_dir.write_summary(self.summary())

    def _take_call(self, c: dict[str, Any], completions: list[str | None], models: dict[str, dict[str, Any]]) -> None:
        """Name a call's longest input and count the call: in its step's models, the summary and the metrics."""
        if c["inputs"]:
            j = max(range(len(c["inputs"])), key=lambda k: c["lengths"][k])
            comp = c["completions"][j] if c["completions"] is not None else None
            t = _text(completions, comp)
            c["longest"] = {"input": c["inputs"][j], "completion": comp, "length": c["lengths"][j],
                            "head": t[:HEAD_CHARS] if t is not None else None}
        owner = owner_of(c["model"])
        m = models.setdefault(owner, {"calls": 0, "seconds": 0.0, "peak_bytes": None, "predicted_bytes": None, "ooms": 0})
        m["calls"] += 1
        m["seconds"] += c["seconds"]
        for k in ("peak_bytes", "predicted_bytes"):
            if c[k] is not None:
                m[k] = max(m[k] or 0, c[k])
        m["ooms"] += c["outcome"] in ("split", "cpu_fallback", "oom")
        err = abs(c["error_ratio"]) if c["error_ratio"] is not None else None
        a = self.models.setdefault(owner, Counter())
        a.update(calls=1, seconds=c["seconds"], ooms_recovered=int(c["outcome"] in ("split", "cpu_fallback")),
                 ooms_lost=int(c["outcome"] == "oom"), errors=int(err is not None), abs_error_sum=err or 0.0)
        a["peak_bytes"] = max(a["peak_bytes"], c["peak_bytes"] or 0)
        a["max_abs_error"] = max(a["max_abs_error"], err or 0.0)
        if c["peak_bytes"]:  # the top calls, highest peak first (the earlier call first on a tie)
            self.top.append({k: c.get(k) for k in TOP_KEYS})
            self.top.sort(key=lambda t: -t["peak_bytes"])
            del self.top[TOP_CALLS:]
        if self.metrics is not None:
            self.metrics.call_seconds.labels(model=owner).observe(c["seconds"])
            if c["peak_bytes"] is not None:
                self.metrics.call_peak.labels(model=owner).observe(c["peak_bytes"])
            if c["error_ratio"] is not None:
                self.metrics.cost_error.labels(model=owner).observe(c["error_ratio"])

    def _write(self, rd: RunDir, recs: list[dict[str, Any]], pending: list[tuple[dict[str, Any], Any, Any]],
               trends: list[Any], record: dict[str, Any], result: Any) -> None:
        """Write the step's incidents, then its records to the timeline and its event."""
        for incident, snapshot, _ in pending:
            incident["file"] = rd.incident(incident, snapshot=snapshot).name
            self.incident_files = [*self.incident_files, incident["file"]][-100:]
        for r in recs:
            rd.timeline(r)
        for incident, _, _ in pending:
            rd.timeline({"type": "oom", "step": incident["step"], "model": incident["model"], "time": incident["time"],
                         "action": incident["action"], "file": incident["file"],
                         "inputs": [i.get("completion") for i in incident["inputs"]]})
        for t in trends:
            rd.timeline({"type": "alarm", "step": record["step"], "time": record["time"], "message": t.describe(), **asdict(t)})
        rd.timeline(record)
        rd.event(result.event)
        rd.flush()

    def _count(self, mt: Metrics, incidents: int, trends: list[Any], record: dict[str, Any], snap: MemorySnapshot,
               result: Any) -> None:
        mt.steps.inc()
        mt.incidents.inc(incidents)
        for t in trends:
            mt.alarms.labels(series=t.series).inc()
        if record["seconds"] is not None:
            mt.step_seconds.observe(record["seconds"])
        mt.observe_snapshot(snap, self.budget_bytes)
        if snap.num_alloc_retries is not None:
            if self._last_retries is not None and snap.num_alloc_retries > self._last_retries:
                mt.alloc_retries.inc(snap.num_alloc_retries - self._last_retries)
            self._last_retries = snap.num_alloc_retries
        for model, statuses in result.model_statuses.items():
            for status, n in Counter(statuses).items():
                mt.completions.labels(model=model, status=status).inc(n)

    # -- the run at a glance ----------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The run so far: per-model peaks, OOMs and cost-model error, the top calls, the alarms."""
        models = {name: {
            "calls": m["calls"], "seconds": m["seconds"], "peak_bytes": m["peak_bytes"],
            "ooms_recovered": m["ooms_recovered"], "ooms_lost": m["ooms_lost"],
            "cost_model_mean_abs_error": m["abs_error_sum"] / m["errors"] if m["errors"] else None,
            "cost_model_max_abs_error": m["max_abs_error"] if m["errors"] else None,
        } for name, m in sorted(self.models.items())}
        return {
            "started": self.started, "updated": time.time(), "device": str(self.device),
            "budget_bytes": self.budget_bytes, "steps": self.steps, "completions": dict(self.statuses),
            "models": models, "top_calls": list(self.top),
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
        if self._memory is not None:  # attached: stop observing (records already made stay)
            self._memory.unsubscribe(self)
        if self._stack is not None and self in self._stack.step_observers:
            self._stack.step_observers.remove(self)
        self.history.stop()
        if self.run_dir is not None:
            with self._lock:
                records, self._records, self._loose = self._loose + self._records, [], []
                pending, self._pending = self._pending, []
            # Trainer calls, and the records of a step that never ended (an interrupted run).
            self._write_without_step(records)
            for incident, snapshot, named in pending:
                incident["step"] = None
                _describe_inputs(incident, named, [])
                self.run_dir.incident(incident, snapshot=snapshot)
            self.run_dir.timeline({"type": "end", "time": time.time(), "steps": self.steps})
            self.run_dir.write_summary(self.summary())
            self.run_dir.close()
