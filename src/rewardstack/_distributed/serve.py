"""The scoring service on Ray Serve: stateless replicas, one state actor per namespace.

Same request and response as `rewardstack serve` (`POST /v1/score`: a step plus optional
`namespace` and `sequence`; out the event line `score` writes plus the `sequence` it was applied
as; errors `{"error": {"message", "type", "field"}}`), with the same limits and sequence rules, but
the two halves of the stack run in different processes:

- **Replicas** (a Serve deployment, `num_gpus` each) load the stack once and run only its stateless
  part (`RewardStack.forward_many`, batched over concurrent requests with `serve.batch`). They
  hold no validator state, so Serve may route any request to any replica and a replica that dies
  loses nothing.
- **Namespace state actors**: each namespace's `RewardState` (normalizers, blacklist, diversity
  history, committed sequence number, the last 64 results and the writer session that fences an
  old client) lives in one named, detached Ray actor. It runs on one event-loop thread and applies steps strictly in sequence order: a step whose
  predecessors are still in a replica's forward pass waits for them (replicas finish out of order),
  a repeat gets the stored result, a gap is 409. It commits each step to
  `<state_dir>/namespaces/<name>/` (the service's layout, through `StateStore`, under the
  service's one-writer `StateLock`) before answering. Ray restarts a dead state actor from
  that file. On a multi-node cluster the state folder must be shared storage (checked).

A request whose replica dies mid-flight can fail at the HTTP proxy; a client retrying with the same
sequence number gets either the stored result (the state actor committed it) or a fresh scoring
(it did not): never a step applied twice. Without a sequence number there is no such protection,
as in `rewardstack serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from ray import serve

from rewardstack.config import StackConfig
from rewardstack._distributed.cluster import RAY_NAMESPACE
from rewardstack._service.errors import ServiceError
from rewardstack._service.edge import authorize, install_error_handlers, loopback_guard, require_json
from rewardstack._service.namespaces import Namespace, reserve, stored_state
from rewardstack._service.protocol import (SCORE_SCHEMA, SESSION_SCHEMA, BodyLimit, client_deadline, error_responses,
                                          namespace_for, parse_score, parse_session, score_responses)
from rewardstack._service import namespaces
from rewardstack._service.app import score_response
from rewardstack._service.worker import WARMUP_STEP, Answer
from rewardstack._settings import ServiceSettings
from rewardstack.stack import Step
from rewardstack._state import ForwardResult
from rewardstack._wire import RECENT_RESULTS

log = logging.getLogger("rewardstack.distributed")

APP_NAME = "rewardstack"
ACTOR_PREFIX = "rewardstack-namespace-"


def actor_name(namespace: str) -> str:
    """The Ray name of a namespace's state actor."""
    return ACTOR_PREFIX + namespace


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


def namespace_actor(config: StackConfig, name: str, state_dir: str) -> Any:
    """The state actor of `name`, created on first use (detached: it outlives the replica asking)."""
    return ray.remote(NamespaceState).options(
        name=actor_name(name), namespace=RAY_NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=1000,
    ).remote(config, name, state_dir)


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
@serve.ingress()
class ScoringReplica:
    """A Serve replica: the stack's stateless part, the service's HTTP surface, no validator state."""

    def __init__(self, config: StackConfig, settings: ServiceSettings, token_hashes: dict[str, str],
                 state_dir: str, reorder_wait_s: float) -> None:
        from rewardstack._service.namespaces import Access
        from transformers.utils import logging as hf_logging

        from rewardstack.stack import RewardStack

        hf_logging.disable_progress_bar()
        self.config = config
        self.settings = settings
        self.access = Access(dict(token_hashes))
        self.state_dir = state_dir
        self.reorder_wait_s = reorder_wait_s
        self.stack = RewardStack(config, load_state=False)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewardstack-forward")
        self.stack.forward(WARMUP_STEP)  # the startup forward pass, as the service does before ready
        self.in_flight = 0
        self.actors: dict[str, Any] = {}
        self.started = time.time()

    def check_health(self) -> None:
        """Serve's health check: the replica is healthy once its stack answered a forward pass."""

    def _actor(self, name: str) -> Any:
        actor = self.actors.get(name)
        if actor is None:
            actor = self.actors[name] = namespace_actor(self.config, name, self.state_dir)
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
            results = await loop.run_in_executor(self.pool, self.stack.forward_many, [items[i][0] for i in live])
            for i, r in zip(live, results):
                out[i] = r
        return out

    def __serve_build_asgi_app__(self) -> Any:
        return build_http_app(self)


def build_http_app(replica: ScoringReplica) -> Any:
    """The replica's FastAPI app: the service's `/v1/score` contract over the split stack."""
    settings = replica.settings
    # The service's guards (service/edge.py, protocol.BodyLimit): loopback without a token answers
    # only this machine's Host and Origin, a step must be sent as JSON, a slow body is cut off.
    local = loopback_guard(settings.host, replica.access)
    app = FastAPI(title="rewardstack on Ray Serve", version="0.1.0",
                  dependencies=[Depends(local)] if local is not None else [],
                  description="The scoring service with stateless replicas and one state actor per namespace. "
                              "See docs/RAY.md.")
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s)
    install_error_handlers(app)  # the service's error chokepoint and access checks (service/edge.py)
    app.state.access, app.state.replica = replica.access, replica
    app.include_router(router)
    return app


router = APIRouter()
"""A replica's routes: plain functions that find their replica on `request.app.state.replica`."""


def _reserve(replica: ScoringReplica, name: str) -> None:
    """Count and create the namespace's folder under one file lock on the shared folder: replicas
    cannot overshoot `service.max_namespaces` (403)."""
    reserve(Path(replica.state_dir) / "namespaces", name, replica.settings.max_namespaces)


def _answer(reply: Answer | ServiceError) -> Response:
    if isinstance(reply, ServiceError):
        raise reply
    return score_response(reply)


async def _call_state(method: Any, *args: Any) -> Any:
    from ray.exceptions import RayActorError

    try:
        return await method.remote(*args)
    except RayActorError:
        # The state actor died (Ray restarts it from its last commit): the client retries with
        # the same sequence number and gets the stored result or a fresh, single application.
        raise ServiceError(503, "state_restarting", "the namespace's state actor restarted; retry with the same "
                           "sequence number", headers={"Retry-After": "1"}) from None


@router.post("/v1/score", summary="Score one step", responses=score_responses(),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": SCORE_SCHEMA}}}})
async def score(request: Request, scope: str | None = Depends(authorize), _json: None = Depends(require_json)) -> Response:
    arrived = time.monotonic()
    replica: ScoringReplica = request.app.state.replica
    settings = replica.settings
    call = parse_score(await request.body(), scope, settings, replica.config.input)  # the service's rules
    _reserve(replica, call.namespace)
    if replica.in_flight >= settings.queue_size:
        raise ServiceError(429, "queue_full", f"the replica has {replica.in_flight} steps in flight; the step "
                           "was not scored", headers={"Retry-After": "1"})
    replica.in_flight += 1
    try:
        actor = replica._actor(call.namespace)
        pre = await _call_state(actor.precheck, call.sequence, call.epoch, call.step)
        if pre is not None:
            return _answer(pre)
        deadline = arrived + min(settings.deadline_s, client_deadline(request.headers))
        fwd = await replica._forward((call.step, deadline))
        if fwd is None:
            raise ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring started; "
                               "the step was not scored (service.deadline_s)")
        # Started: it commits whatever happens to the client (shielded from its disconnect).
        return _answer(await asyncio.shield(_call_state(actor.commit, call.sequence, call.epoch, fwd,
                                                        replica.reorder_wait_s)))
    finally:
        replica.in_flight -= 1


@router.get("/v1/namespaces/{name}", summary="A namespace's committed sequence number, epoch and session holder",
            responses=error_responses(401, 403, 422))
async def namespace_info(name: str, request: Request, scope: str | None = Depends(authorize)) -> dict:
    replica: ScoringReplica = request.app.state.replica
    name = namespace_for(name, scope)
    try:
        actor = ray.get_actor(actor_name(name), namespace=RAY_NAMESPACE)
        standing = await _call_state(actor.standing)
    except ValueError:  # no actor: read the committed file
        folder = Path(replica.state_dir) / "namespaces" / name
        standing = namespaces.describe(await asyncio.to_thread(stored_state, replica.config, folder))
    return {"namespace": name, **standing}


@router.post("/v1/namespaces/{name}/sessions", summary="Open a session on a namespace, fencing the one before",
             openapi_extra={"requestBody": {"content": {"application/json": {"schema": SESSION_SCHEMA}}}},
             responses=error_responses(400, 401, 403, 415, 422, 503))
async def open_session(name: str, request: Request, scope: str | None = Depends(authorize),
                       _json: None = Depends(require_json)) -> dict:
    replica: ScoringReplica = request.app.state.replica
    name = namespace_for(name, scope)
    who = parse_session(await request.body())
    _reserve(replica, name)
    reply = await _call_state(replica._actor(name).open_session, who.model_dump())
    if isinstance(reply, ServiceError):
        raise reply
    return {"namespace": name, **reply}


@router.get("/healthz", summary="Liveness of this replica")
async def healthz(request: Request) -> dict:
    replica: ScoringReplica = request.app.state.replica
    return {"status": "ok", "in_flight": replica.in_flight, "up_s": round(time.time() - replica.started, 1),
            "replica": {"pid": os.getpid(), "host": os.uname().nodename}}


@router.get("/readyz", summary="Readiness: this replica loaded its models and ran a forward pass")
async def readyz() -> dict:
    return {"status": "ready"}  # Serve routes to a replica only after its constructor returned


@router.get("/v1/stack", summary="Models, device and limits of this replica", responses=error_responses(401))
async def stack_info(request: Request, scope: str | None = Depends(authorize)) -> dict:
    replica: ScoringReplica = request.app.state.replica
    return {
        "device": str(replica.stack.device),
        "models": [m.name for m in replica.config.active_models()],
        "limits": {k: getattr(replica.settings, k) for k in ("max_body_bytes", "max_completions", "max_chars",
                                                              "deadline_s", "queue_size")},
        "state_dir": replica.state_dir,
    }


def build_app(config: StackConfig, settings: ServiceSettings, token_hashes: dict[str, str], *, state_dir: str,
              replicas: int = 1, gpus_per_replica: float = 0.0, cpus_per_replica: float = 1.0,
              reorder_wait_s: float | None = None) -> Any:
    """The Serve application: `replicas` stateless replicas over namespace state actors in `state_dir`.

    `reorder_wait_s` is how long a step waits at its state actor for predecessors still in a
    forward pass before it is a 409 gap (default: the service's deadline).
    """
    from rewardstack._distributed.scoring import worker_config

    config = worker_config(config, gpus_per_replica)
    deployment = serve.deployment(
        ScoringReplica, name="ScoringReplica", num_replicas=replicas,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        # The replica admits up to queue_size steps itself and answers 429 past that, like the service.
        max_ongoing_requests=settings.queue_size + 1, health_check_period_s=5, graceful_shutdown_timeout_s=20,
    )
    wait = settings.deadline_s if reorder_wait_s is None else reorder_wait_s
    return deployment.bind(config, settings, dict(token_hashes), str(Path(state_dir).resolve()), wait)
