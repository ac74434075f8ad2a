"""The scoring worker: one thread owns the device, the models and every namespace's state, and schedules both lanes.

One lock and one condition guard everything that waits for the device: validators' steps (`Job`s,
in namespace lines) and trainer requests (the lane, service/batching.py). Both are admitted by
`submit`, under that lock, and every admission notifies the condition, so no wake-up is lost.
The thread alternates: when both kinds wait, a validator turn and a trainer slice take turns, and
a trainer slice is bounded in tokens whether or not a step waits (`service.slice_tokens`), so a
step waits for at most one slice of trainer work (and the turns of other namespaces ahead of it),
whenever it arrives and whatever the trainers send.

A validator turn takes what is queued (up to
`batch_requests` jobs at once), checks each job's sequence number against its namespace, runs the
stateless part of the stack for the admitted jobs (`RewardStack.forward_many`: model by model over
all of them, so a model's weights are used once per batch, not once per request), then applies
the stateful part job by job, in queue order, to each job's own namespace state, commits every
touched namespace once (atomically, through `StateStore`), and only then answers. So:

- whose score is whose: each job keeps its own `ForwardResult`; nothing is merged across jobs;
- a namespace's steps are applied in the order they were queued, and a response is sent only after
  the state that includes it is on disk;
- a job whose deadline passed, or whose client went away, before the worker started it is not
  scored (`Job.try_start` and `Job.try_cancel` race under a lock: exactly one wins); once started,
  it is scored and committed whatever happens to its client.

The heartbeat (what the worker runs now, when its last forward pass finished) is written by the
worker and read without waiting by `/healthz`.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from rewardstack.config import StackConfig
from rewardstack.errors import StateError
from rewardstack._service.batching import Claim, Lane, StatelessJob
from rewardstack._service.errors import ServiceError
from rewardstack._service.namespaces import Namespaces
from rewardstack._service import namespaces
from rewardstack._service.protocol import memory_summary, step_work
from rewardstack.stack import RewardStack, Step, StepResult
from rewardstack._state import RewardState

log = logging.getLogger("rewardstack.service")

SESSION = "session"
"""A job that opens a session on its namespace (`namespaces.open_session`), in the namespace's order."""

WARMUP_STEP = Step(name="augment", prompt="rewardstack startup check.",
                   completions=["A short startup completion.", "Another startup completion?"])
"""Scored (forward pass only, nothing committed) before the service reports ready."""


@dataclass
class Answer:
    """What the worker answers a job with: the response body (JSON text) and whether it was scored."""

    body: str
    sequence: int
    scored: bool
    memory: dict[str, Any] | None = None
    """The summary of the step's memory record (protocol.memory_summary) when it was scored now."""


@dataclass
class Job(Claim):
    """One request to score a step for a namespace."""

    namespace: str
    step: Step | None
    """The step to score (None for a session job)."""
    sequence: int | None
    deadline: float
    """time.monotonic() after which the job is not started."""
    epoch: int | None = None
    """The client's session (`namespaces.admit` fences an older one)."""
    kind: str = "score"
    """`score` a step, or open a `SESSION` (then `client` says who opens it)."""
    client: dict[str, Any] | None = None


class Worker:
    """The thread that loads the stack and scores every job; the app talks to it through `submit`."""

    def __init__(self, config: StackConfig, *, queue_size: int = 64, batch_requests: int = 16,
                 max_namespaces: int = 64,
                 run_dir: str | None = None, turn_work: int | None = None, lane: Lane | None = None,
                 recalibrate: bool = False) -> None:
        self.config = config
        self.lane = lane if lane is not None else Lane(config.service)
        """The trainer routes' stateless requests, scored in slices between validator turns (service/batching.py)."""
        self.run_dir = run_dir if run_dir is not None else config.telemetry.run_dir
        """Telemetry run directory (timeline, events, incidents, summary); None: none written."""
        self.telemetry: Any = None
        self.batch_requests = max(1, batch_requests)
        self.queue_size = queue_size
        self._incoming: collections.deque[Job] = collections.deque()  # admitted steps not yet in a line
        self._wake = threading.Condition()  # guards _incoming, the lane, closed/draining; notified on every change
        self._last_turn = "trainer"  # which lane ran last: when both wait, the other goes
        # Jobs taken off the queue and waiting for a turn, one line per namespace (worker thread only).
        self._lines: dict[str, collections.deque[tuple[int, Job]]] = {}
        self._waiting = 0  # jobs in the lines (read by the app's thread for the queue length)
        self._arrivals = 0  # arrival order of the jobs in the lines
        self._served: dict[str, int] = {}  # namespace -> when it last had a job taken (the rotation)
        self._picks = 0
        self.turn_work = turn_work if turn_work is not None else config.service.max_work_chars
        """Most work (`protocol.step_work`) one turn takes, after its first job (`service.max_work_chars`)."""
        self.namespaces = Namespaces(config, max_namespaces=max_namespaces)
        self.stack: RewardStack | None = None
        self.recalibrate = recalibrate
        self.closed = False
        self.draining = False
        self.ready = False
        self.error: str | None = None
        self.heartbeat: dict[str, Any] = {"running": "starting", "since": time.time(), "last_forward_at": None}
        self.scored = 0
        self.step_seconds = 0.0  # running mean of a scored step's time (for Retry-After)
        self.on_fatal: Callable[[], None] | None = None
        """Called from the worker thread when the stack fails to load (the command stops the server)."""
        self._thread = threading.Thread(target=self._main, name="rewardstack-worker", daemon=True)

    # -- app side -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def queue_length(self) -> int:
        """Steps waiting for the worker (admitted, or taken into their namespace's line)."""
        return len(self._incoming) + self._waiting

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue's expected drain time, at least 1."""
        per = self.step_seconds or 1.0
        return max(1, math.ceil(self.queue_length() * per / self.batch_requests))

    def submit(self, job: Job | StatelessJob) -> None:
        """Admit a validator's step or a trainer request, or raise ServiceError 503 (not ready,
        shutting down) or 429 (its lane is full). The one admission path of both lanes."""
        with self._wake:
            self.check_ready()
            if isinstance(job, StatelessJob):
                self.lane.admit(job)
            else:
                if self.queue_length() >= self.queue_size:  # steps waiting for a turn count too
                    raise ServiceError(429, "queue_full", f"the queue is full ({self.queue_size} steps waiting); "
                                       "the step was not scored", headers={"Retry-After": str(self.retry_after())})
                self._incoming.append(job)
            self._wake.notify()

    def check_ready(self) -> None:
        """Raise ServiceError 503 unless the worker takes work now (loaded, not shutting down)."""
        if self.closed or self.draining:
            raise ServiceError(503, "shutting_down", "the service is shutting down; nothing was scored",
                               headers={"Retry-After": "5"})
        if not self.ready or self.stack is None:
            raise ServiceError(503, "not_ready", "the service is still loading its models; nothing was scored",
                               headers={"Retry-After": "5"})

    def begin_drain(self) -> None:
        """Stop accepting: the running batch finishes and commits, queued jobs get 503. Thread-safe."""
        with self._wake:
            self.draining = True
            self.ready = False
            self._wake.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- worker thread ------------------------------------------------------------------------
    def _beat(self, running: str | None, *, forward_done: bool = False) -> None:
        beat = {"running": running, "since": time.time(), "last_forward_at": self.heartbeat.get("last_forward_at")}
        if forward_done:
            beat["last_forward_at"] = time.time()
        self.heartbeat = beat  # one assignment: readers see the old dict or the new one

    def _main(self) -> None:
        try:
            self._beat("loading models")
            self.stack = RewardStack(self.config, load_state=False, recalibrate=self.recalibrate)
            if self.run_dir is not None:
                from rewardstack._telemetry.session import Telemetry

                # The app serves /metrics itself; the run directory records every committed step.
                self.telemetry = Telemetry(self.stack, run_dir=self.run_dir, metrics_port=None,
                                           settings=self.config.telemetry)
            if not self.lane.slice_tokens:  # one full pass of each trainer model
                self.lane.slice_tokens = sum(getattr(self.stack.scorers.get(m.name), "max_tokens", 0)
                                             for m in self.config.user_rewards()) or 4096
            self._beat("startup forward pass")
            self.stack.forward(WARMUP_STEP)
            self._beat(None, forward_done=True)
            self.ready = not self.draining
            log.info("worker ready")
        except Exception as e:  # noqa: BLE001 - reported through /readyz and the exit status
            log.exception("the stack failed to load")
            self.error = f"{type(e).__name__}: {e}"
            self._beat(None)
            self._close()
            if self.on_fatal is not None:
                self.on_fatal()
            return
        try:
            while True:
                turn = self._next_turn()
                if turn is None:
                    break
                self._last_turn = turn
                if turn == "steps":
                    batch = self._take()
                    if batch:
                        self._process(batch)
                else:
                    with self._wake:
                        pieces = self.lane.take(time.monotonic())
                    self.lane.run(self.stack, pieces, self._beat)
        finally:
            self._close()

    def _next_turn(self) -> str | None:
        """Wait for work; which lane goes next (`steps` or `trainer`), None once draining.

        When both wait, the lane that did not run last goes: a step waits for at most one trainer
        slice, and trainers for at most one validator turn."""
        with self._wake:
            while not self.draining:
                self._admit()
                due = self.lane.due_in(time.monotonic())
                steps = bool(self._lines)
                if steps and due == 0.0:
                    return "trainer" if self._last_turn == "steps" else "steps"
                if steps:
                    return "steps"
                if due == 0.0:
                    return "trainer"
                self._wake.wait(timeout=due if due is not None else 1.0)
            return None

    def _take(self) -> list[Job]:
        """The next turn's jobs: fair between namespaces, each namespace's own in order.

        Queued jobs join their namespace's line. A turn takes jobs one at a time from the line of
        the namespace served least recently (a namespace new to the rotation goes first), up to
        `batch_requests` jobs and `turn_work` of work (the first job always fits); a job joins
        only if the turn already holds at least as much work as it brings, so joining at most
        doubles the turn: a large request never rides along with a small one (whose answer would
        then wait for it), while requests of like size still share a turn. So a namespace that
        sends many large requests gets one turn's share in rotation, and another namespace's small
        request waits for the turn that is running, not for every request queued before it.
        Within the turn, jobs run in arrival order.
        """
        with self._wake:
            self._admit()
        picked: list[tuple[int, Job]] = []
        work = 0
        while self._lines and len(picked) < self.batch_requests:
            name = min(self._lines, key=lambda n: self._served.get(n, -1))  # ties: the earliest to arrive
            line = self._lines[name]
            session = line[0][1].kind == SESSION
            cost = 0 if session else step_work(line[0][1].step)  # type: ignore[arg-type]
            if picked and (session or work + cost > self.turn_work or cost > work):
                break
            picked.append(line.popleft())
            work += cost
            self._waiting -= 1
            self._served[name] = self._picks
            self._picks += 1
            if not line:
                del self._lines[name]
            if session:  # its own turn: the namespace's earlier steps have committed, later ones wait
                break
        if len(self._served) > 4 * max(64, self.namespaces.max_namespaces):  # names of refused requests too
            self._served = {n: t for n, t in self._served.items() if n in self._lines}
        return [job for _, job in sorted(picked, key=lambda p: p[0])]

    def _admit(self) -> None:
        """Move the admitted steps into their namespaces' lines (the caller holds the lock)."""
        while self._incoming:
            job = self._incoming.popleft()
            self._lines.setdefault(job.namespace, collections.deque()).append((self._arrivals, job))
            self._arrivals += 1
            self._waiting += 1

    def _close(self) -> None:
        """No more jobs: answer what is queued with 503, commit every namespace, stop."""
        with self._wake:
            self.closed = True
            self.ready = False
            self._admit()
            waiting = [job for line in self._lines.values() for _, job in line]
            self._lines.clear()
            self._waiting = 0
            self.lane.close()
        for job in waiting:
            if job.try_cancel():
                job.answer(ServiceError(503, "shutting_down", "the service shut down before this step started; "
                                        "it was not scored", headers={"Retry-After": "5"}))
        for ns in self.namespaces.loaded():
            try:
                ns.commit()  # logs its own failure
            except Exception:  # noqa: BLE001 - its reload failed too: the other namespaces still commit
                log.exception("namespace %s: final commit failed", ns.name)
        self.namespaces.release()
        if self.telemetry is not None:
            self.telemetry.close()
            self.telemetry = None
        self._beat(None)

    def _process(self, batch: list[Job]) -> None:
        now = time.monotonic()
        started: list[Job] = []
        for job in batch:
            if not job.try_start():
                continue  # the client withdrew it (deadline or disconnect) before it started
            if job.deadline < now:
                job.answer(ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring "
                                        "started; the step was not scored"))
                continue
            started.append(job)
        if len(started) == 1 and started[0].kind == SESSION:  # `_take` gives a session its own turn
            self._open_session(started[0])
            return
        # Sequence numbers: plan what each job will be applied as, counting the jobs before it in
        # this batch (they commit first). A repeat of a committed step gets the stored answer; a
        # repeat of a job in this batch gets that job's answer.
        expected: dict[str, int] = {}
        in_batch: dict[tuple[str, int], Job] = {}
        to_score: list[Job] = []
        duplicates: list[tuple[Job, Job]] = []
        created: list[str] = []
        limit = self.config.input.max_chars
        for job in started:
            try:
                ns = self.namespaces.peek(job.namespace)  # creates nothing: a refused step leaves no folder
                state = ns.state if ns is not None else RewardState(self.config)
                exp = expected.setdefault(job.namespace, state.sequence + 1)
                verdict = namespaces.admit(state, job.namespace, job.step, sequence=job.sequence, epoch=job.epoch,
                                           expected=exp, max_chars=limit)
                if verdict == namespaces.GO and ns is None:  # a new namespace, made for a step that will be scored
                    self.namespaces.get(job.namespace)
                    created.append(job.namespace)
            except (ServiceError, StateError, OSError) as e:
                job.answer(_refusal(e))
                continue
            if verdict == namespaces.GO:
                expected[job.namespace] = exp + 1
                in_batch[(job.namespace, exp)] = job
                to_score.append(job)
            elif verdict == namespaces.PENDING:
                duplicates.append((job, in_batch[(job.namespace, job.sequence)]))  # type: ignore[index]
            elif verdict == namespaces.AHEAD:
                job.answer(namespaces.sequence_gap(job.namespace, job.sequence or 0, exp))
            else:  # a retry of a committed step: its kept answer, and the memory record kept with it
                job.answer(Answer(verdict, job.sequence or 0, scored=False,
                                   memory=namespaces.kept_memory(state, job.sequence or 0)))
        if to_score:
            self._score(to_score)
        for name in created:  # made this turn for steps that all failed: leave nothing behind
            self.namespaces.discard(name)
        for job, original in duplicates:  # answered like a repeat of a committed step
            if original.future.exception() is not None:  # answered above: the retry gets what the original got
                job.answer(original.future.exception())
                continue
            done: Answer = original.future.result()
            same = namespaces.step_digest(job.step, limit) == namespaces.step_digest(original.step, limit)
            job.answer(Answer(done.body, done.sequence, scored=False, memory=done.memory) if same
                       else namespaces.sequence_conflict(job.namespace, done.sequence, expected[job.namespace]))

    def _open_session(self, job: Job) -> None:
        """Open a session on the job's namespace, after every step admitted before it committed."""
        try:
            job.answer(self.namespaces.get(job.namespace).open_session(job.client or {}))
        except (ServiceError, StateError, OSError) as e:
            job.answer(_refusal(e))

    def _score(self, jobs: list[Job]) -> None:
        assert self.stack is not None
        t0 = time.monotonic()
        # Counted, not named: /healthz shows the heartbeat to anyone, and a namespace's name is
        # often a validator's hotkey.
        count = len({j.namespace for j in jobs})
        self._beat(f"forward pass: {len(jobs)} step(s), {sum(len(j.step.completions) for j in jobs)} completions, "
                   f"{count} namespace(s)")
        try:
            forwards = self.stack.forward_many([j.step for j in jobs])  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - scorers already catch their own; this is a last resort
            log.exception("forward pass failed")
            for job in jobs:
                job.answer(ServiceError(500, "internal", "the forward pass failed; the step was not scored"))
            self._beat(None)
            return
        self._beat("applying rewards", forward_done=True)
        applied: list[tuple[Job, StepResult, str]] = []
        broken: set[str] = set()  # a step failed to apply: the namespace's steps of this turn are not committed
        for job, fwd in zip(jobs, forwards):
            if job.namespace in broken:
                job.answer(ServiceError(500, "internal", "an earlier step of this namespace failed; not scored"))
                continue
            try:
                applied.append((job, *self.namespaces.get(job.namespace).apply(fwd)))
            except Exception:  # noqa: BLE001 - logged; memory is back to the file
                broken.add(job.namespace)
                job.answer(ServiceError(500, "internal", "applying the step to the state failed; not scored"))
        self._beat("committing state")
        for name in dict.fromkeys(job.namespace for job, _, _ in applied):
            if name not in broken and not self.namespaces.get(name).commit():
                broken.add(name)
        for job, result, body in applied:
            if job.namespace in broken:
                job.answer(ServiceError(500, "state_error", "the state could not be committed; the step was not applied"))
                continue
            # Telemetry and the operator's callbacks see every committed step; the answer carries
            # the summary of its memory record, and a retry gets it too.
            memory = memory_summary(self.stack.publish_step(result, record=True) or {})
            namespaces.keep_memory(self.namespaces.get(job.namespace).state, result.sequence or 0, memory)
            job.answer(Answer(body, result.sequence or 0, scored=True, memory=memory))
        elapsed = time.monotonic() - t0
        self.scored += len(applied)
        per = elapsed / max(1, len(jobs))
        self.step_seconds = per if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * per
        self._beat(None)


def _refusal(e: Exception) -> ServiceError:
    """The answer to a step or session its namespace refused: a limit or a refusal of the admission
    (a ServiceError), or a state it cannot read."""
    return e if isinstance(e, ServiceError) else ServiceError(500, "state_error", str(e), field="namespace")
