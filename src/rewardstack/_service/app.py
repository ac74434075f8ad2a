"""The HTTP scoring service: a FastAPI app on uvicorn in front of one scoring worker.

    rewardstack serve --config C [--host 127.0.0.1] [--port 8000]

Routes: `POST /v1/score` (one step in, its event out), `GET /v1/namespaces/{name}`,
`POST /v1/namespaces/{name}/sessions` (service/namespaces.py), the trainer routes (service/trainers.py),
`GET /v1/stack`, `GET /healthz`, `GET /readyz`, `GET /metrics`, and FastAPI's `/openapi.json` and
`/docs`. Every refusal is a `ServiceError`, turned into `{"error": {"message", "type", "field"}}` by
the exception handlers of service/edge.py (the one place errors become responses). The request
contract (schemas, limits, body parsing, deadlines, sequence rules) is service/protocol.py, shared
with the Ray Serve replicas: bodies are strict JSON of bounded nesting, validated by
`Step.from_dict` exactly as `rewardstack score` validates a line; no pickle and no code from a
request, anywhere. See docs/SERVICE.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rewardstack.config import MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import StateError
from rewardstack._service.edge import (CutAtShutdown, answer_of, authorize, install_error_handlers, loopback_guard,
                                      require_json, as_service_error)
from rewardstack._service.errors import ServiceError
from rewardstack._service import namespaces
from rewardstack._service.access import ALL_NAMESPACES, Access
from rewardstack._service.namespaces import stored_state
from rewardstack._service.protocol import (MEMORY_HEADER, SCORE_SCHEMA, SESSION_SCHEMA, BodyLimit, client_deadline,
                                          error_responses, namespace_for, parse_score, parse_session, score_responses)
from rewardstack._service.batching import Lane
from rewardstack._service import trainers
from rewardstack._service.worker import SESSION, Answer, Job, Worker
from rewardstack._settings import ServiceSettings
from rewardstack._telemetry.metrics import registry

log = logging.getLogger("rewardstack.service")

# -- the app ----------------------------------------------------------------------------------

def service_metrics() -> SimpleNamespace:
    """The service's own instruments (`requests`, `queue`, `latency`) on the telemetry registry, made
    once per registry (another app in the process shares them)."""
    from prometheus_client import Counter, Gauge, Histogram

    reg = registry()
    if id(reg) not in _METRICS:
        _METRICS[id(reg)] = SimpleNamespace(
            requests=Counter("rewardstack_service_requests_total", "Requests answered, by route and HTTP status.",
                             ["route", "code"], registry=reg),
            queue=Gauge("rewardstack_service_queue_length", "Steps waiting for the scoring worker.", registry=reg),
            latency=Histogram("rewardstack_service_request_seconds", "Time from a score request's arrival to its answer.",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=reg),
        )
    return _METRICS[id(reg)]


_METRICS: dict[int, SimpleNamespace] = {}


def create_app(config: StackConfig, settings: ServiceSettings, access: Access, *, worker: Worker | None = None,
               recalibrate: bool = False) -> FastAPI:
    """The FastAPI app; its lifespan starts the worker (models load in the worker's thread, profiled
    again with `recalibrate` instead of reading saved cost models and tuned settings)."""
    worker = worker or service_worker(config, settings, recalibrate=recalibrate)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.begin_drain()
        await asyncio.to_thread(worker.join)

    app = http_app(Service(worker, config, settings), settings, access, title="rewardstack", lifespan=lifespan,
                   description="Scores validator steps with the reward stack; one worker owns the device. See docs/SERVICE.md.")
    app.add_middleware(CutAtShutdown)  # outermost: the drain's cancellation is one line, not a traceback
    app.add_api_route("/metrics", metrics_route, summary="Prometheus metrics", responses=error_responses(401))
    add_trainer_routes(app, worker, config, settings)
    return app


def service_worker(config: StackConfig, settings: ServiceSettings, *, lane: Lane | None = None,
                   recalibrate: bool = False) -> Worker:
    """The scoring worker of `rewardstack serve` (and of each Ray Serve replica), sized by `[service]`."""
    return Worker(config, queue_size=settings.queue_size, batch_requests=settings.batch_requests,
                  max_namespaces=settings.max_namespaces, turn_work=settings.max_work_chars,
                  lane=lane if lane is not None else Lane(settings), recalibrate=recalibrate)


def add_trainer_routes(app: FastAPI, worker: Worker, config: StackConfig, settings: ServiceSettings) -> None:
    """The trainer routes (/get_reward, /classify, /v1/models, /health: docs/TRAINERS.md), answered
    by `worker`'s lane; `rewardstack serve` and the Ray Serve replicas both add them."""
    app.state.worker, app.state.config, app.state.settings = worker, config, settings
    app.state.metrics = service_metrics()  # the routes count their answers (a replica's app too)
    app.include_router(trainers.router)


def http_app(server: Any, settings: ServiceSettings, access: Access, **fastapi: Any) -> FastAPI:
    """A FastAPI app of the shared `routes`, answered by `server` (`Service`, or a Ray Serve replica),
    behind the edge both servers share: the loopback guard, the body limit and the error handlers."""
    local = loopback_guard(settings.host, access)  # loopback without a token: Host and Origin must be this machine
    app = FastAPI(version="0.1.0", dependencies=[Depends(local)] if local is not None else [], **fastapi)
    app.state.server, app.state.access = server, access
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s)
    install_error_handlers(app)  # the one error chokepoint (service/edge.py)
    app.include_router(routes)
    return app


routes = APIRouter()
"""The routes `rewardstack serve` and the Ray Serve replicas share (one contract): each asks the
app's server (`request.app.state.server`) for its answer."""


@routes.post("/v1/score", summary="Score one step", responses=score_responses(),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": SCORE_SCHEMA}}}})
async def score(request: Request, scope: str | None = Depends(authorize), _json: None = Depends(require_json)) -> Response:
    return await request.app.state.server.score(request, scope)


@routes.get("/v1/namespaces/{name}", summary="A namespace's committed sequence number, epoch and session holder",
            responses=error_responses(401, 403, 422))
async def namespace_info(name: str, request: Request, scope: str | None = Depends(authorize)) -> dict:
    name = namespace_for(name, scope)
    return {"namespace": name, **await request.app.state.server.standing(name)}


@routes.post("/v1/namespaces/{name}/sessions", summary="Open a session on a namespace, fencing the one before",
             openapi_extra={"requestBody": {"content": {"application/json": {"schema": SESSION_SCHEMA}}}},
             responses=error_responses(400, 401, 403, 415, 422, 429, 503, 504))
async def open_session(name: str, request: Request, scope: str | None = Depends(authorize),
                       _json: None = Depends(require_json)) -> dict:
    name = namespace_for(name, scope)
    who = parse_session(await request.body())
    return {"namespace": name, **await request.app.state.server.open_session(request, name, who.model_dump())}


@routes.get("/healthz", summary="Liveness: the worker's (or replica's) heartbeat, answered at once")
async def healthz(request: Request) -> JSONResponse:
    return request.app.state.server.health()


@routes.get("/readyz", summary="Readiness: models loaded and a startup forward pass done; 503 while starting or draining")
async def readyz(request: Request) -> JSONResponse:
    return request.app.state.server.readiness()


@routes.get("/v1/stack", summary="Models, placement, budget, cost models, queue", responses=error_responses(401, 503))
async def stack_info(request: Request, scope: str | None = Depends(authorize)) -> dict:
    return request.app.state.server.describe(scope)


async def metrics_route(request: Request, scope: str | None = Depends(authorize)) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    request.app.state.metrics.queue.set(request.app.state.worker.queue_length())
    return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)


def score_response(answer: Answer) -> Response:
    """A score answer: its body, whether it was scored now, its memory record's summary when it has one
    (Ray Serve's replicas answer through this too)."""
    headers = {"X-Rewardstack-Scored": "true" if answer.scored else "false"}
    if answer.memory is not None:
        headers[MEMORY_HEADER] = namespaces.memory_header(answer.memory)
    return Response(answer.body, media_type="application/json", headers=headers)


class Service:
    """The answers of `rewardstack serve` to the shared routes: one worker owns the device and every
    namespace; steps and sessions go through its queue."""

    def __init__(self, worker: Worker, config: StackConfig, settings: ServiceSettings) -> None:
        self.worker, self.config, self.settings = worker, config, settings

    async def score(self, request: Request, scope: str | None) -> Response:
        arrived = time.monotonic()
        metrics = request.app.state.metrics
        code = 500
        try:
            name, sequence, epoch, step = parse_score(await request.body(), scope, self.settings, self.config.input)
            # A new namespace past service.max_namespaces is refused by the worker, which creates
            # namespaces one at a time (checking here would race with concurrent first requests).
            deadline = arrived + min(self.settings.deadline_s, client_deadline(request.headers))
            job = Job(name, step, sequence, deadline=deadline, epoch=epoch)
            self.worker.submit(job)  # 429 when full, 503 when not ready or draining
            answer = await answer_of(request, job, deadline)
            code = 200
            return score_response(answer)
        except Exception as e:
            code = as_service_error(e).status  # the status the error handlers send (a step's InputError is a 422)
            raise
        finally:
            metrics.requests.labels(route="/v1/score", code=str(code)).inc()
            metrics.latency.observe(time.monotonic() - arrived)
            metrics.queue.set(self.worker.queue_length())

    async def standing(self, name: str) -> dict[str, Any]:
        """Where a namespace stands (`namespaces.describe`): from memory when loaded, else from its state file."""
        for ns in self.worker.namespaces.loaded():
            if ns.name == name:
                return namespaces.describe(ns.state)
        folder = self.worker.namespaces.root / name
        try:
            return namespaces.describe(await asyncio.to_thread(stored_state, self.config, folder))
        except StateError as e:
            raise self.worker.namespaces.unreadable(name, e) from None

    async def open_session(self, request: Request, name: str, client: dict[str, Any]) -> dict[str, Any]:
        # Through the worker's queue, behind the namespace's steps already queued: its `next` counts
        # every step admitted before it.
        deadline = time.monotonic() + min(self.settings.deadline_s, client_deadline(request.headers))
        job = Job(name, None, None, deadline=deadline, kind=SESSION, client=client)
        self.worker.submit(job)
        return await answer_of(request, job, deadline)

    def health(self) -> JSONResponse:
        worker = self.worker
        beat = dict(worker.heartbeat)
        alive = worker.alive or worker.closed
        body = {
            "status": "ok" if alive and worker.error is None else "failed",
            "running": beat.get("running"),
            "running_for_s": round(time.time() - beat["since"], 3) if beat.get("running") else None,
            "last_forward_at": beat.get("last_forward_at"),
            "queue_length": worker.queue_length(),
            "ready": worker.ready,
            "error": worker.error,
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    def readiness(self) -> JSONResponse:
        worker = self.worker
        if worker.ready:
            return JSONResponse({"status": "ready"})
        reason = ("failed: " + worker.error) if worker.error else ("draining" if worker.draining or worker.closed else "starting")
        return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "5"})

    def describe(self, scope: str | None) -> dict:
        return describe(self.worker, self.config, self.settings, scope)


def describe(worker: Worker, config: StackConfig, settings: ServiceSettings, scope: str | None = None) -> dict:
    """What `/v1/stack` shows: models and their placement, the budget, cost models, the queue.

    `scope` is the caller's (`guard.authorize`): a token bound to one namespace sees that namespace
    only; the names of the others (often validators' hotkeys) are not its business.
    """
    stack = worker.stack
    if stack is None or not (worker.ready or worker.draining):
        raise ServiceError(503, "not_ready", "the models are still loading", headers={"Retry-After": "5"})
    placement: dict = {}
    cost_models: dict = {}
    for _ in range(3):  # the worker may be adding a cost model or swapping a model in while this reads them
        try:
            placement = stack.memory.placement.summary() if stack.memory.placement is not None else {}
            cost_models = {n: c.to_dict() for n, c in stack.memory.cost_models.items()}
            break
        except RuntimeError:
            continue
    models = []
    for name in REWARD_MODELS + MASKS:
        m = config.models[name]
        if not m.active:
            continue
        models.append({"name": name, "kind": "reward" if name in REWARD_MODELS else "mask", "weight": m.weight,
                       "path": m.path, "paths": m.paths or None, "dtype": m.dtype,
                       "device": str(stack.memory.device_for(name)) if name in stack.scorers else None})
    budget = stack.memory.budget
    return {
        "device": str(stack.device),
        "models": models,
        "placement": placement,
        "budget": dataclasses.asdict(budget) if budget is not None else {"activation_bytes": stack.memory.budget_bytes},
        "cost_models": cost_models,
        "queue": {"length": worker.queue_length(), "size": worker.queue_size, "batch_requests": worker.batch_requests},
        "trainer": {"waiting": len(worker.lane), "queued_tokens": worker.lane.queued_tokens,
                    "slice_tokens": worker.lane.slice_tokens, "batches": worker.lane.batches,
                    "requests": worker.lane.requests},
        "namespaces": [name for name in sorted({ns.name for ns in worker.namespaces.loaded()} |
                                               set(worker.namespaces.on_disk()))
                       if scope in (None, ALL_NAMESPACES) or name == scope],
        "limits": {k: getattr(settings, k) for k in ("max_body_bytes", "max_completions", "max_chars", "max_work_chars",
                                                      "deadline_s")},
        "steps_scored": worker.scored,
    }
