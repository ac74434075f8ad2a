"""Cross-request batching for the stateless trainer routes: a lane beside the validators' queue.

The service's one worker thread owns the device (service/worker.py); trainer requests
(`StatelessJob`: texts or chats to score with the `[rewards.*]` models) wait in this lane, not in
the validators' queue, and the worker runs them between validator turns: every request waiting
when a batch starts is scored together, each model once over all their inputs (identical inputs
once), through the memory layer (`MemoryManager.run`: the plan, the OOM guard, the records). A
request waits for company at most `service.batch_wait_s`; requests that arrive while the worker
is busy batch anyway. No namespace, state or sequence number is read or written here, so a
validator's steps keep their order and exactly-once; a trainer batch delays a validator's step by at
most one batch, as a validator turn does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rewardstack.errors import InputError
from rewardstack._service.errors import ServiceError
from rewardstack._settings import ServiceSettings
from rewardstack._telemetry.metrics import observe_trainer_batch

log = logging.getLogger("rewardstack.service")

WAKE = object()
"""Put on the validators' queue to wake the worker for the lane (at most one there at a time)."""


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
        """Client side: withdraw the job; False once the worker has started it (it will commit)."""
        with self._lock:
            if self.phase == "queued":
                self.phase = "cancelled"
            return self.phase == "cancelled"

    def answer(self, outcome: Any) -> None:
        """The job's answer, or the exception its waiter raises (the first one only)."""
        if not self.future.done():
            (self.future.set_exception if isinstance(outcome, BaseException) else self.future.set_result)(outcome)


class StatelessJob(Claim):
    """One trainer request: inputs (a text, or a chat the model's template renders), the models."""

    def __init__(self, items: Sequence[Any], fields: Sequence[str], models: Sequence[str], deadline: float,
                 special: bool | None = None) -> None:
        super().__init__()
        self.items, self.fields, self.models, self.deadline = list(items), list(fields), list(models), deadline
        self.special = special
        """Whether the tokenizer adds its special tokens to a text (None: the scorer's default;
        `HfRewardScorer.encode`): the route's convention, carried to the scorer."""
        self.work = sum(len(str(item)) for item in self.items) * max(1, len(self.models))
        """Characters the models read (each input once per model): what a batch is bounded by."""


class Lane:
    """The trainer requests waiting for the worker, and how the worker scores them in batches."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.wait_s = settings.batch_wait_s
        self.batch = settings.stateless_batch
        self.capacity = settings.stateless_queue
        self.work = settings.max_work_chars
        self._jobs: collections.deque[StatelessJob] = collections.deque()
        self._lock = threading.Lock()
        self._woken = False
        self.batches = 0
        """Batches scored (the bench and the tests read how requests were grouped)."""
        self.requests = 0
        """Requests scored (with `batches`: how requests were grouped, for /v1/stack and the bench)."""

    def __len__(self) -> int:
        return len(self._jobs)

    # -- app side -----------------------------------------------------------------------------
    def submit(self, job: StatelessJob, worker: Any) -> None:
        """Queue a job for `worker`, or raise 503 (not ready, shutting down) or 429 (lane full)."""
        if worker.closed or worker.draining or not worker.ready:
            what = "is shutting down" if worker.closed or worker.draining else "is still loading its models"
            raise ServiceError(503, "not_ready", f"the service {what}; nothing was scored", headers={"Retry-After": "5"})
        with self._lock:
            if len(self._jobs) >= self.capacity:
                raise ServiceError(429, "queue_full", f"{self.capacity} trainer requests are waiting "
                                   "(service.stateless_queue); nothing was scored", headers={"Retry-After": "1"})
            self._jobs.append(job)
            wake, self._woken = not self._woken, True
        if wake:
            try:
                worker.queue.put_nowait(WAKE)
            except queue.Full:  # the worker is busy with validator steps and will come round anyway
                pass

    # -- worker side --------------------------------------------------------------------------
    def offer(self, item: Any) -> bool:
        """Whether an item off the validators' queue was the lane's wake-up (then it is consumed)."""
        if item is WAKE:
            with self._lock:
                self._woken = False
            return True
        return False

    def timeout(self, idle: float) -> float:
        """How long the worker may block waiting for validator steps: until the lane's batch is due."""
        with self._lock:
            if not self._jobs:
                return idle
            if len(self._jobs) >= self.batch or sum(j.work for j in self._jobs) >= self.work:
                return 0.0
            return min(idle, max(0.0, self._jobs[0].enqueued + self.wait_s - time.monotonic()))

    def run_due(self, stack: Any, beat: Callable[..., None], share: int | None = None) -> None:
        """Score the waiting requests if their wait for company is over (worker thread).

        `share`: the work of the validator step waiting next, if one is. A batch then holds at most
        that much text (the first request always fits), so validator turns and trainer batches
        alternate in equal shares and a step waits for one batch of its own size, not for every
        trainer request queued before it; with no step waiting, at most `service.max_work_chars`.
        """
        if self.timeout(1.0) > 0:
            return
        most = self.work if share is None else max(1, min(self.work, share))
        with self._lock:
            jobs: list[StatelessJob] = []
            work = 0
            while self._jobs and len(jobs) < self.batch and (not jobs or work + self._jobs[0].work <= most):
                work += self._jobs[0].work
                jobs.append(self._jobs.popleft())
        now = time.monotonic()
        started = []
        for job in jobs:
            if not job.try_start():
                continue  # withdrawn: deadline or client gone
            if job.deadline < now:
                job.answer(ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring "
                                        "started; nothing was scored"))
                continue
            started.append(job)
        if not started:
            return
        inputs = sum(len(j.items) for j in started)
        beat(f"trainer batch: {len(started)} request(s), {inputs} inputs")
        tokens = 0
        try:
            tokens = score_batch(stack, started)
        except Exception:  # noqa: BLE001 - a last resort: every job gets an answer
            log.exception("trainer batch failed")
            for job in started:
                job.answer(ServiceError(500, "internal", "the forward pass failed; nothing was scored"))
        observe_trainer_batch(len(started), inputs, tokens, [now - j.enqueued for j in started])
        self.batches += 1
        self.requests += len(started)
        beat(None, forward_done=True)

    def close(self) -> None:
        """No more batches: answer every waiting job 503."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
        for job in jobs:
            if job.try_cancel():
                job.answer(ServiceError(503, "shutting_down", "the service shut down before this request was "
                                        "scored", headers={"Retry-After": "5"}))


def score_batch(stack: Any, jobs: list[StatelessJob]) -> int:
    """Score every job's inputs with its models, each model once over all of them; answer each job.
    Returns the tokens read (the jobs answered, over their models)."""
    failed: dict[int, BaseException] = {}
    results: dict[int, Scored] = {id(j): Scored({}, {}, 0) for j in jobs}
    for name in dict.fromkeys(m for j in jobs for m in j.models):
        mine = [j for j in jobs if name in j.models and id(j) not in failed]
        answers = stack.scorers[name].score_groups([list(zip(j.items, j.fields)) for j in mine],
                                                   specials=[j.special for j in mine]) if mine else []
        for job, reads in zip(mine, answers):
            if isinstance(reads, InputError):
                failed[id(job)] = ServiceError(422, "invalid_request", str(reads), field=reads.field)
                continue
            bad = next((r.outcome for r in reads if r.outcome.status != "ok" or not math.isfinite(float(r.outcome.value))),
                       None)
            if bad is not None:
                failed[id(job)] = ServiceError(503, "not_scored", f"{name} could not score an input ({bad.status}); "
                                               "nothing was scored, retry later", headers={"Retry-After": "1"})
                continue
            results[id(job)].scores[name] = [float(r.outcome.value) for r in reads]
            results[id(job)].truncated[name] = [r.cut for r in reads]
            results[id(job)].tokens += sum(r.tokens for r in reads)
    for job in jobs:
        job.answer(failed.get(id(job)) or results[id(job)])
    return sum(results[id(j)].tokens for j in jobs if id(j) not in failed)
