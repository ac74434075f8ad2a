"""The scoring service and the trainer routes on Ray Serve: stateless replicas behind one proxy,
one state actor per namespace.

The routes of `rewardstack serve`, declared once (service/app.py's `routes`, service/trainers.py's
`router`): the trainer routes (`/get_reward`, `/classify`, `/v1/models`, `/health`) and `POST
/v1/score` (a step plus optional `namespace` and `sequence`; out the event line `score` writes plus
the `sequence` it was applied as; errors `{"error": {"message", "type", "field"}}`), with the same
limits and sequence rules, but spread over processes:

- **Replicas** (a Serve deployment, `num_gpus` each) each run the service's worker: the stack
  loaded once under the replica's own memory plan, and the trainer lane batching the requests this
  replica receives. `/v1/score` runs only the stack's stateless part here (`RewardStack.forward_many`,
  batched over concurrent requests with `serve.batch`) under the device lock the lane's batches
  take. Replicas hold no validator state, so Serve may route any request to any replica and a
  replica that dies loses nothing. Serve's own bounds hold a burst (`deployment_options`): at most
  `max_ongoing_requests` per replica, the rest waiting at the proxy up to `max_queued_requests`,
  then 503 with Retry-After.
- **Namespace state actors**: each namespace's `RewardState` (normalizers, blacklist, diversity
  history, committed sequence number, the last 64 results and the writer session that fences an
  old client) lives in one named, detached Ray actor. It runs on one event-loop thread and applies steps strictly in sequence order: a step whose
  predecessors are still in a replica's forward pass waits for them (replicas finish out of order),
  a repeat gets the stored result, a gap is 409. It commits each step to
  `<state_dir>/namespaces/<name>/` (the service's layout, through `StateStore`, under the
  service's one-writer `StateLock`) before answering. Ray restarts a dead state actor from
  that file. On a multi-node cluster the state folder must be shared storage (checked).

A request whose replica dies mid-flight fails at the HTTP proxy: a trainer's client resends it (a
retry, never a lost reward); a validator retrying with the same sequence number gets either the
stored result (the state actor committed it) or a fresh scoring (it did not): never a step applied
twice. Without a sequence number there is no such protection, as in `rewardstack serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from fastapi.responses import JSONResponse, Response
from ray import serve

from rewardstack.config import StackConfig
from rewardstack._distributed.cluster import RAY_NAMESPACE
from rewardstack._service.errors import ServiceError
from rewardstack._service.namespaces import Namespace, reserve, stored_state
from rewardstack._service.protocol import client_deadline, parse_score
from rewardstack._service import namespaces
from rewardstack._service.app import add_trainer_routes, http_app, score_response, service_worker
from rewardstack._service.batching import Lane
from rewardstack._service.worker import Answer
from rewardstack._settings import ServiceSettings
from rewardstack.stack import Step
from rewardstack._state import ForwardResult
from rewardstack._wire import RECENT_RESULTS

log = logging.getLogger("rewardstack.distributed")

APP_NAME = "rewardstack"


def actor_name(namespace: str) -> str:
    """The Ray name of a namespace's state actor."""
    return "rewardstack-namespace-" + namespace


# -- the namespace state actor --------------------------------------------------------------------
class NamespaceState:
    """One namespace's state; an async Ray actor, so every call runs on its one event-loop thread.

    Between two `await`s nothing else runs, and `commit` does not await between checking the
    sequence number and writing the state: steps are applied one at a time, in sequence order.
    A refusal is returned, not raised, so that it crosses Ray unchanged: every call answers a
    value, the worker's `Answer` or a `ServiceError`. Admission is the service's (service/namespaces.py).
    """

    def __init__(self, config: StackConfig, name: str, state_dir: str) -> None:
        # The folder was reserved by the replica (the namespace limit); one writer: not also a `rewardstack serve`.
        self.ns = Namespace(config, Path(state_dir) / "namespaces", name)
        self.turn = asyncio.Condition()

    def _admit(self, sequence: int | None, epoch: int | None, step: Step) -> str | Answer | ServiceError:
        """The service's rule (`namespaces.admit`) against the committed state: `GO`, `AHEAD`, or the
        answer (a retry's kept answer, or a refusal)."""
        state = self.ns.state
        try:
            verdict = namespaces.admit(state, self.ns.name, step, sequence=sequence, epoch=epoch,
                                       expected=state.sequence + 1, max_chars=state.config.input.max_chars)
        except ServiceError as e:
            return e
        return verdict if verdict in (namespaces.GO, namespaces.AHEAD) else Answer(verdict, sequence or 0, scored=False)

    async def precheck(self, sequence: int | None, epoch: int | None, step: Step) -> Answer | ServiceError | None:
        """Before the forward pass: a repeat's stored answer, a refusal, a hopeless gap's 409, else None (go on)."""
        verdict = self._admit(sequence, epoch, step)
        if verdict == namespaces.AHEAD and (sequence or 0) - (self.ns.state.sequence + 1) > RECENT_RESULTS:
            return namespaces.sequence_gap(self.ns.name, sequence or 0, self.ns.state.sequence + 1)  # not in flight
        return None if isinstance(verdict, str) else verdict

    async def commit(self, sequence: int | None, epoch: int | None, fwd: ForwardResult,
                     wait_s: float) -> Answer | ServiceError:
        """Apply one step's forward result as `sequence` (or as the next one) and commit it to disk."""
        async with self.turn:
            loop = asyncio.get_running_loop()
            until = loop.time() + wait_s
            while (verdict := self._admit(sequence, epoch, fwd.step)) == namespaces.AHEAD:  # predecessors in a forward pass
                try:
                    await asyncio.wait_for(self.turn.wait(), max(0.0, until - loop.time()))
                except TimeoutError:
                    return namespaces.sequence_gap(self.ns.name, sequence or 0, self.ns.state.sequence + 1)
            if not isinstance(verdict, str):
                return verdict
            # From here to the end: no await, so nothing else touches the state.
            try:
                _, body = self.ns.apply(fwd)  # applied, its answer kept for retries
                committed = self.ns.commit()
            except Exception:  # noqa: BLE001 - logged; memory is back to the file
                committed = False
            if not committed:
                return ServiceError(500, "state_error", "the step could not be applied and committed; not scored")
            self.turn.notify_all()
            return Answer(body, self.ns.state.sequence, scored=True)

    async def standing(self) -> dict:
        """Where the namespace stands (`namespaces.describe`)."""
        return namespaces.describe(self.ns.state)

    async def open_session(self, client: dict) -> dict | ServiceError:
        """Open a session (`Namespace.open_session`, committed) after the step being applied now."""
        async with self.turn:
            try:
                answer = self.ns.open_session(client)
            except ServiceError as e:
                return e
            self.turn.notify_all()  # steps of the old epoch waiting for predecessors are refused now
            return answer


def stop_namespace_actors(state_dir: str | Path) -> int:
    """Kill the state actors of every namespace in `state_dir` (each has committed all it answered)."""
    root = Path(state_dir) / "namespaces"
    n = 0
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            actor = ray.get_actor(actor_name(folder.name), namespace=RAY_NAMESPACE)
        except ValueError:  # no actor for it (never used since the start, or already stopped)
            continue
        ray.kill(actor, no_restart=True)
        n += 1
    return n


# -- the replicas ---------------------------------------------------------------------------------
class DeviceLane(Lane):
    """The worker's trainer lane with each slice under the replica's device lock, which the
    replica's `/v1/score` forward passes take too: one thread at a time drives the stack."""

    def __init__(self, settings: ServiceSettings, device: threading.Lock) -> None:
        super().__init__(settings)
        self.device = device

    def run(self, stack: Any, pieces: list, beat: Any) -> None:
        with self.device:
            super().run(stack, pieces, beat)


@serve.ingress()
class ScoringReplica:
    """A Serve replica: the one-process service's worker (the stack loaded once under its own
    memory plan, the trainer routes' lane batching the requests this replica receives) and the
    service's HTTP surface (service/app.py's shared routes and trainer routes); its `/v1/score`
    runs the stack's stateless part here and the state in the namespaces' state actors."""

    def __init__(self, config: StackConfig, settings: ServiceSettings, token_hashes: dict[str, str],
                 state_dir: str, reorder_wait_s: float) -> None:
        from rewardstack._service.access import Access
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if not logging.getLogger().handlers:  # the replica's stderr is its Ray log: which model loads (n of N), calibrating
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger("rewardstack").setLevel(logging.INFO)
        self.config = config
        self.settings = settings
        self.access = Access(dict(token_hashes))
        self.state_dir = state_dir
        self.reorder_wait_s = reorder_wait_s
        self.device = threading.Lock()
        self.worker = service_worker(config, settings, lane=DeviceLane(settings, self.device))
        self.worker.start()  # loads, calibrates and runs the startup pass in its thread
        while not (self.worker.ready or self.worker.error):
            time.sleep(0.05)
        if self.worker.error:  # Serve retries the constructor, then reports the deployment unhealthy
            raise RuntimeError(f"the stack failed to load: {self.worker.error}")
        self.stack = self.worker.stack
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewardstack-forward")
        self.in_flight = 0
        self.actors: dict[str, Any] = {}
        self.started = time.time()

    def __serve_build_asgi_app__(self) -> Any:
        app = http_app(self, self.settings, self.access, title="rewardstack on Ray Serve",
                       description="The scoring service and the trainer routes on stateless replicas, with one state "
                                   "actor per namespace. See docs/RAY.md.")
        add_trainer_routes(app, self.worker, self.config, self.settings)
        return app

    def check_health(self) -> None:
        """Serve's health check: a replica whose worker thread died is replaced."""
        if self.worker.error or not self.worker.alive:
            raise RuntimeError(f"the scoring worker stopped: {self.worker.error or 'its thread ended'}")

    def _actor(self, name: str) -> Any:
        """The namespace's state actor, its folder first reserved under one file lock on the shared
        folder: replicas cannot overshoot `service.max_namespaces` (403)."""
        reserve(Path(self.state_dir) / "namespaces", name, self.settings.max_namespaces)
        actor = self.actors.get(name)
        if actor is None:  # created on first use (detached: it outlives the replica asking)
            actor = self.actors[name] = ray.remote(NamespaceState).options(
                name=actor_name(name), namespace=RAY_NAMESPACE, get_if_exists=True, lifetime="detached",
                num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=1000,
            ).remote(self.config, name, self.state_dir)
        return actor

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _forward(self, items: list[tuple[Step, float]]) -> list[ForwardResult | None]:
        """Forward passes of concurrent requests together (model by model), each a step and the time
        after which it is not started; None: that deadline passed."""
        now = time.monotonic()
        live = [i for i, (_, deadline) in enumerate(items) if deadline >= now]
        out: list[ForwardResult | None] = [None] * len(items)
        if live:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self.pool, self._forward_locked, [items[i][0] for i in live])
            for i, r in zip(live, results):
                out[i] = r
        return out

    def _forward_locked(self, steps: list[Step]) -> list[ForwardResult]:
        with self.device:  # the worker's trainer batches wait meanwhile
            return self.stack.forward_many(steps)

    async def score(self, request: Any, scope: str | None) -> Response:
        arrived = time.monotonic()
        settings = self.settings
        name, sequence, epoch, step = parse_score(await request.body(), scope, settings, self.config.input)
        actor = self._actor(name)
        if self.in_flight >= settings.queue_size:
            raise ServiceError(429, "queue_full", f"the replica has {self.in_flight} steps in flight; the step "
                               "was not scored", headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            pre = await _call_state(actor.precheck, sequence, epoch, step)
            if pre is not None:
                return score_response(pre)
            deadline = arrived + min(settings.deadline_s, client_deadline(request.headers))
            fwd = await self._forward((step, deadline))
            if fwd is None:
                raise ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring started; "
                                   "the step was not scored (service.deadline_s)")
            # Started: it commits whatever happens to the client (shielded from its disconnect).
            return score_response(await asyncio.shield(_call_state(actor.commit, sequence, epoch, fwd,
                                                                   self.reorder_wait_s)))
        finally:
            self.in_flight -= 1

    async def standing(self, name: str) -> dict:
        try:
            return await _call_state(ray.get_actor(actor_name(name), namespace=RAY_NAMESPACE).standing)
        except ValueError:  # no actor: read the committed file
            folder = Path(self.state_dir) / "namespaces" / name
            return namespaces.describe(await asyncio.to_thread(stored_state, self.config, folder))

    async def open_session(self, request: Any, name: str, client: dict) -> dict:
        return await _call_state(self._actor(name).open_session, client)

    def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "in_flight": self.in_flight, "up_s": round(time.time() - self.started, 1),
                             "replica": {"pid": os.getpid(), "host": os.uname().nodename}})

    def readiness(self) -> JSONResponse:
        return JSONResponse({"status": "ready"})  # Serve routes to a replica only after its constructor returned

    def describe(self, scope: str | None) -> dict:
        return {
            "device": str(self.stack.device),
            "models": [m.name for m in self.config.active_models()],
            "limits": {k: getattr(self.settings, k) for k in ("max_body_bytes", "max_completions", "max_chars",
                                                              "deadline_s", "queue_size")},
            "state_dir": self.state_dir,
        }


async def _call_state(method: Any, *args: Any) -> Any:
    """A state actor's answer; the refusal it returned raised."""
    from ray.exceptions import RayActorError

    try:
        reply = await method.remote(*args)
    except RayActorError:
        # The state actor died (Ray restarts it from its last commit): the client retries with
        # the same sequence number and gets the stored result or a fresh, single application.
        raise ServiceError(503, "state_restarting", "the namespace's state actor restarted; retry with the same "
                           "sequence number", headers={"Retry-After": "1"}) from None
    if isinstance(reply, ServiceError):
        raise reply
    return reply


MAX_QUEUED_REQUESTS = 16384
"""Requests each Serve proxy holds for the replicas (past `max_ongoing_requests` each) before it
answers 503 with Retry-After: four 4,096-request trainer bursts at once."""


TRAINER_BATCH = 256
"""Trainer requests a replica counts on scoring together (one-sample requests of a slice): its
Serve bounds are set in these."""


def deployment_options(settings: ServiceSettings, *, replicas: int = 1, max_replicas: int | None = None,
                       gpus_per_replica: float = 0.0, cpus_per_replica: float = 1.0,
                       max_ongoing_requests: int | None = None,
                       max_queued_requests: int = MAX_QUEUED_REQUESTS) -> dict[str, Any]:
    """The replicas' Serve options: resources, and the bounds Serve's router keeps.

    A replica takes up to `max_ongoing_requests` requests at once (default: `2 x TRAINER_BATCH`,
    two slices' worth of one-sample requests, so one fills while the other runs; at least
    `service.queue_size + 1`, as a replica answers a validator's step 429 itself past `queue_size`
    in flight; at most `service.stateless_queue`, so its lane never refuses what Serve sent it).
    Past that, requests wait at Serve's proxy for a free replica (any replica: one that dies only
    loses what it was running), up to `max_queued_requests` per proxy (-1: no bound), then 503 with
    Retry-After, which OpenRLHF's and verl's clients resend (verl does not resend a 4xx). With
    `max_replicas` above `replicas`, Serve's autoscaler keeps between the two, aiming at one trainer
    batch in flight per replica.
    """
    ongoing = max_ongoing_requests or min(settings.stateless_queue, max(settings.queue_size + 1, 2 * TRAINER_BATCH))
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        "max_ongoing_requests": ongoing, "max_queued_requests": max_queued_requests,
        "backpressure_config": {"status_code": 503, "retry_after_s": 1},
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": 20,
    }
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": min(ongoing, TRAINER_BATCH)}
    else:
        options["num_replicas"] = replicas
    return options


def build_app(config: StackConfig, settings: ServiceSettings, token_hashes: dict[str, str], *, state_dir: str,
              gpus_per_replica: float = 0.0, reorder_wait_s: float | None = None, **options: Any) -> Any:
    """The Serve application: stateless replicas (`deployment_options`' keywords: `replicas`,
    `max_replicas`, `cpus_per_replica`, `max_ongoing_requests`, `max_queued_requests`) over
    namespace state actors in `state_dir`.

    `reorder_wait_s` is how long a step waits at its state actor for predecessors still in a
    forward pass before it is a 409 gap (default: the service's deadline).
    """
    from rewardstack._distributed.scoring import worker_config

    # Replicas write no telemetry run folder: several processes would share one.
    config = worker_config(config, gpus_per_replica)
    config = config.model_copy(update={"telemetry": config.telemetry.model_copy(update={"run_dir": None})})
    deployment = serve.deployment(ScoringReplica, name="ScoringReplica",
                                  **deployment_options(settings, gpus_per_replica=gpus_per_replica, **options))
    wait = settings.deadline_s if reorder_wait_s is None else reorder_wait_s
    return deployment.bind(config, settings, dict(token_hashes), str(Path(state_dir).resolve()), wait)
