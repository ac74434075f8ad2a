"""The trainer lane: stateless trainer requests waiting for the scheduler, and how a slice of them is scored.

The service's one worker thread owns the device and schedules both kinds of work (service/worker.py):
validator steps in namespace turns, and slices of this lane. A trainer request (`StatelessJob`:
texts or chats to score with the `[rewards.*]` models) arrives here already tokenized, on the
request's own thread (`HfRewardScorer.prepare`): an input that cannot be read fails its own request
with a 422 before it joins anything, and the device thread never tokenizes.

The lane's one rule is counted in tokens. A slice takes inputs in arrival order, across requests,
up to `service.slice_tokens` (the first input always goes): a large request is scored over several
slices and answered when its last input is, so what any other request (a validator's step among
them) waits for is at most one slice, whatever the trainers send. Each model runs once per slice
over every input in it (identical inputs once), through the memory layer (`MemoryManager.run`: the
plan, the OOM guard, the records). Rows are padded to widths of their own (scorers/hfreward.py), so
company changes no score. No namespace, state or sequence number is read or written here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from rewardstack._service.errors import ServiceError
from rewardstack._telemetry.metrics import observe_trainer_batch

log = logging.getLogger("rewardstack.service")


@dataclass
class Scored:
    """One request's answer: per model, a score and a truncation flag per input; tokens read."""

    scores: dict[str, list[float]]
    truncated: dict[str, list[bool]]
    tokens: int


@dataclass(kw_only=True, eq=False)  # a request is itself: compared and hashed by identity
class Claim:
    """A request waiting for the worker: the worker claims it (`try_start`) unless its client
    withdrew it first (`try_cancel`: deadline passed, client gone, shutdown), never both; `answer`
    settles its future once. The validators' jobs (service/worker.py) and the trainers' alike."""

    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)
    phase: str = "queued"
    """queued -> started (the worker took it) or cancelled."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def try_start(self) -> bool:
        """Worker side: claim the job; False if it was withdrawn first."""
        with self._lock:
            if self.phase != "queued":
                return False
            self.phase = "started"
            return True

    def try_cancel(self) -> bool:
        """Client side: withdraw the job; False once the worker has started it (it will finish)."""
        with self._lock:
            if self.phase == "queued":
                self.phase = "cancelled"
            return self.phase == "cancelled"

    def answer(self, outcome: Any) -> None:
        """The job's answer, or the exception its waiter raises (the first one only)."""
        if not self.future.done():
            (self.future.set_exception if isinstance(outcome, BaseException) else self.future.set_result)(outcome)


class StatelessJob(Claim):
    """One trainer request: per model, its inputs tokenized ahead (`HfRewardScorer.prepare`)."""

    def __init__(self, rows: Mapping[str, Sequence[Any]], deadline: float) -> None:
        super().__init__()
        self.rows = {name: list(encoded) for name, encoded in rows.items()}
        self.models = list(self.rows)
        self.deadline = deadline
        self.size = len(next(iter(self.rows.values()))) if self.rows else 0
        """Inputs in the request (each scored by every model)."""
        self.costs = [sum(len(self.rows[m][i].ids) for m in self.models) for i in range(self.size)]
        """Tokens each input asks of the models together: what slices are counted in."""
        self.tokens = sum(self.costs)
        self.taken = 0
        """Inputs handed to slices so far (worker thread)."""
        self.left = self.size
        """Inputs not yet scored (worker thread)."""
        self.result = Scored({m: [0.0] * self.size for m in self.models},
                             {m: [False] * self.size for m in self.models}, 0)
        self.failure: ServiceError | None = None


def prepare_job(stack: Any, items: Sequence[Any], names: Sequence[str], models: Sequence[str], deadline: float,
                special: bool | None = None) -> StatelessJob:
    """A trainer request's job: every input tokenized for every model it names (`names[i]` is
    input i's field), with the route's `special` convention (`HfRewardScorer.encode`), on the
    caller's thread; InputError naming the first input that cannot be."""
    return StatelessJob({name: [stack.scorers[name].prepare(item, where, special) for item, where in zip(items, names)]
                         for name in models}, deadline)


def score_now(stack: Any, jobs: Sequence[StatelessJob]) -> None:
    """Score whole jobs together in one slice and answer them (in process: the tests and the
    bench's scoring-path rows, without the worker)."""
    for job in jobs:
        job.try_start()
        job.taken = job.size
    score_slice(stack, [Piece(job, 0, job.size) for job in jobs])
    for job in jobs:
        job.answer(job.failure or job.result)


@dataclass
class Piece:
    """Inputs `start` to `end` of a job, in one slice."""

    job: StatelessJob
    start: int
    end: int


class Lane:
    """The trainer requests waiting for the worker, counted in tokens; the worker's lock guards it."""

    def __init__(self, settings: Any) -> None:
        self.wait_s = settings.batch_wait_s
        self.capacity = settings.stateless_queue
        self.max_tokens = settings.max_queued_tokens
        self.slice_tokens = settings.slice_tokens
        self._jobs: collections.deque[StatelessJob] = collections.deque()
        self.queued_tokens = 0
        """Tokens of the inputs not yet handed to a slice: what admission bounds."""
        self.rate = 0.0
        """Tokens scored per second, a running mean (for Retry-After)."""
        self.batches = 0
        """Slices scored (the bench and the tests read how requests were grouped)."""
        self.requests = 0
        """Requests answered from slices (with `batches`: how requests were grouped, for /v1/stack)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def admit(self, job: StatelessJob) -> None:
        """Queue a job (the caller holds the worker's lock), or raise 429 past the bounds."""
        if len(self._jobs) >= self.capacity or (self._jobs and self.queued_tokens + job.tokens > self.max_tokens):
            wait = max(1, math.ceil(self.queued_tokens / self.rate)) if self.rate else 1
            raise ServiceError(429, "queue_full", f"the trainer requests waiting hold {self.queued_tokens} tokens "
                               f"({len(self._jobs)} requests; bounds: service.max_queued_tokens = {self.max_tokens}, "
                               f"service.stateless_queue = {self.capacity}); nothing was scored",
                               headers={"Retry-After": str(wait)})
        self._jobs.append(job)
        self.queued_tokens += job.tokens

    def due_in(self, now: float) -> float | None:
        """Seconds until a slice is due (0: now; None: nothing waits): when the first request has
        waited `service.batch_wait_s` for company, or a full slice waits."""
        if not self._jobs:
            return None
        if self.queued_tokens >= self.slice_tokens:
            return 0.0
        return max(0.0, self._jobs[0].enqueued + self.wait_s - now)

    def take(self, now: float) -> list[Piece]:
        """The next slice (the caller holds the worker's lock): inputs in arrival order up to
        `slice_tokens` (the first always goes). A job is claimed when its first input is taken;
        one withdrawn or past its deadline before that is dropped (answered 504 if past it)."""
        pieces: list[Piece] = []
        tokens = 0
        while self._jobs and tokens < self.slice_tokens:
            job = self._jobs[0]
            if tokens and tokens + job.costs[job.taken] > self.slice_tokens:
                break  # the slice is full
            if job.failure is not None or (job.taken == 0 and not _claim(job, now)):
                self._jobs.popleft()  # answered already (an earlier slice failed it), withdrawn or late
                self.queued_tokens -= sum(job.costs[job.taken:])
                continue
            start = end = job.taken
            while end < job.size and (tokens == 0 or tokens + job.costs[end] <= self.slice_tokens):
                tokens += job.costs[end]
                self.queued_tokens -= job.costs[end]
                end += 1
            if end > start:
                pieces.append(Piece(job, start, end))
                job.taken = end
            if job.taken == job.size:
                self._jobs.popleft()
            if end < job.size:
                break  # the slice is full
        return pieces

    def run(self, stack: Any, pieces: list[Piece], beat: Callable[..., None]) -> None:
        """Score a slice (worker thread, lock not held): answer every job whose last input it held."""
        if not pieces:
            return
        inputs = sum(p.end - p.start for p in pieces)
        beat(f"trainer slice: {inputs} inputs of {len({id(p.job) for p in pieces})} request(s)")
        t0 = time.monotonic()
        try:
            score_slice(stack, pieces)
        except Exception:  # noqa: BLE001 - a last resort: every job gets an answer
            log.exception("trainer slice failed")
            for p in pieces:
                p.job.failure = p.job.failure or ServiceError(500, "internal", "the forward pass failed; nothing was scored")
        elapsed = time.monotonic() - t0
        tokens = sum(sum(p.job.costs[p.start:p.end]) for p in pieces)
        if elapsed > 0:
            self.rate = tokens / elapsed if not self.rate else 0.8 * self.rate + 0.2 * tokens / elapsed
        for p in pieces:
            job = p.job
            job.left -= p.end - p.start
            if job.failure is not None:
                job.answer(job.failure)
            elif job.left == 0:
                job.answer(job.result)
                self.requests += 1
        self.batches += 1
        observe_trainer_batch(len({id(p.job) for p in pieces}), inputs, tokens,
                              [t0 - p.job.enqueued for p in pieces if p.start == 0])
        beat(None, forward_done=True)

    def close(self) -> None:
        """No more slices: answer every waiting job 503."""
        jobs, self._jobs = list(self._jobs), collections.deque()
        self.queued_tokens = 0
        for job in jobs:
            if job.taken == 0 and not job.try_cancel():
                continue
            job.answer(ServiceError(503, "shutting_down", "the service shut down before this request was "
                                    "scored", headers={"Retry-After": "5"}))


def _claim(job: StatelessJob, now: float) -> bool:
    """Claim a job for its first slice; False (answered 504 if past its deadline) if it cannot be."""
    if not job.try_start():
        return False  # withdrawn: deadline or client gone
    if job.deadline < now:
        job.answer(ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring "
                                "started; nothing was scored"))
        return False
    return True


def score_slice(stack: Any, pieces: list[Piece]) -> None:
    """Score every piece's inputs with its job's models, each model once over all of them; the
    scores land in each job's `result`, a failed input sets its job's `failure`."""
    for name in dict.fromkeys(m for p in pieces for m in p.job.models):
        mine = [p for p in pieces if name in p.job.models and p.job.failure is None]
        if not mine:
            continue
        reads = stack.scorers[name].score_encoded([row for p in mine for row in p.job.rows[name][p.start:p.end]])
        at = 0
        for p in mine:
            job, got = p.job, reads[at:at + p.end - p.start]
            at += p.end - p.start
            bad = next((r.outcome for r in got if r.outcome.status != "ok" or not math.isfinite(float(r.outcome.value))),
                       None)
            if bad is not None:
                job.failure = ServiceError(503, "not_scored", f"{name} could not score an input ({bad.status}); "
                                           "nothing was scored, retry later", headers={"Retry-After": "1"})
                continue
            job.result.scores[name][p.start:p.end] = [float(r.outcome.value) for r in got]
            job.result.truncated[name][p.start:p.end] = [r.cut for r in got]
            job.result.tokens += sum(r.tokens for r in got)
