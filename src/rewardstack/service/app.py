"""The HTTP scoring service: a FastAPI app on uvicorn in front of one scoring worker.

    rewardstack serve --config C [--host 127.0.0.1] [--port 8000]

Routes: `POST /v1/score` (one step in, its event out), `GET /v1/namespaces/{name}`,
`GET /v1/stack`, `GET /healthz`, `GET /readyz`, `GET /metrics`, and FastAPI's `/openapi.json` and
`/docs`. Every refusal is a `ServiceError`, turned into `{"error": {"message", "type", "field"}}` by
the exception handlers below (the one place errors become responses). Bodies are parsed with the
standard `json` module and validated by `Step.from_dict`, exactly as `rewardstack score` validates
a line: no pickle and no code from a request, anywhere. See docs/SERVICE.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rewardstack.config import MASKS, REWARD_MODELS, StackConfig
from rewardstack.service.errors import ServiceError
from rewardstack.service.guard import authorizer, install_error_handlers, namespace_for
from rewardstack.service.namespaces import DEFAULT_NAMESPACE, NAME_RE, Access
from rewardstack.service.worker import Job, Worker
from rewardstack.settings import ServiceSettings
from rewardstack.stack import Step

log = logging.getLogger("rewardstack.service")

SCORE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "prompt", "completions"],
    "properties": {
        "name": {"type": "string", "description": "augment, followupN or answerN"},
        "prompt": {"type": "string"},
        "completions": {"type": "array", "items": {"type": ["string", "null"]},
                        "description": "null marks a failed response (not scored)"},
        "base_prompt": {"type": "string", "description": "what the masks compare against (default: prompt)"},
        "uids": {"type": "array", "items": {"type": "integer"}},
        "completion_times": {"type": "array", "items": {"type": "number"}},
        "failed": {"type": "array", "items": {"type": "boolean"}},
        "block": {"type": "integer"},
        "gating_loss": {"type": "number"},
        "set_weights": {},
        "new_forward_pass": {"type": "boolean"},
        "namespace": {"type": "string", "pattern": f"^{NAME_RE.pattern}$", "default": DEFAULT_NAMESPACE},
        "sequence": {"type": "integer", "minimum": 1,
                     "description": "the namespace's step number; a repeat returns the stored result"},
    },
}
ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "field": {"type": ["string", "null"]}}}}}


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"description": "error", "content": {"application/json": {"schema": ERROR_SCHEMA}}} for c in codes}


# -- request size, counted as the bytes arrive ------------------------------------------------

class BodyLimit:
    """Pure ASGI middleware: a body past `limit` bytes raises ServiceError(413) from `receive`.

    The count is of bytes received, so a chunked body or a lying Content-Length cannot get past
    it; a declared Content-Length over the limit fails at the first read without waiting for the
    bytes. Raising from `receive` puts the error inside the route, where the app's exception
    handlers answer it like every other error.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        received = 0
        limit = self.limit

        def too_large() -> ServiceError:
            return ServiceError(413, "body_too_large", f"the request body is larger than {limit} bytes "
                                "(service.max_body_bytes)", field="body")

        async def limited_receive() -> dict:
            nonlocal received
            if declared is not None and declared > limit:
                raise too_large()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large()
            return message

        await self.app(scope, limited_receive, send)


# -- the app ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Metrics:
    """The service's own instruments, on the telemetry registry when it is there."""

    requests: Any
    queue: Any
    latency: Any

    @classmethod
    def create(cls) -> "Metrics":
        from prometheus_client import Counter, Gauge, Histogram

        reg = metrics_registry()
        key = id(reg)
        if key not in _METRICS:
            _METRICS[key] = cls(
                Counter("rewardstack_service_requests_total", "Score requests answered, by HTTP status.", ["code"], registry=reg),
                Gauge("rewardstack_service_queue_length", "Steps waiting for the scoring worker.", registry=reg),
                Histogram("rewardstack_service_request_seconds", "Time from a score request's arrival to its answer.",
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=reg),
            )
        return _METRICS[key]


_METRICS: dict[int, Metrics] = {}


def metrics_registry() -> Any:
    """The telemetry registry (`rewardstack.telemetry.metrics.registry()`), else prometheus_client's."""
    try:
        from rewardstack.telemetry.metrics import registry
    except ImportError:  # pragma: no cover - telemetry not installed in this build
        from prometheus_client import REGISTRY

        return REGISTRY
    return registry()


def create_app(config: StackConfig, settings: ServiceSettings, access: Access, *, worker: Worker | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the worker (models load in the worker's thread)."""
    worker = worker or Worker(config, queue_size=settings.queue_size, batch_requests=settings.batch_requests,
                              max_namespaces=settings.max_namespaces)
    metrics = Metrics.create()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.begin_drain()
        await asyncio.to_thread(worker.join)

    app = FastAPI(title="rewardstack", version="0.1.0", lifespan=lifespan,
                  description="Scores validator steps with the reward stack; one worker owns the device. See docs/SERVICE.md.")
    app.state.worker = worker
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    install_error_handlers(app)  # the one error chokepoint (service/guard.py)
    authorize = authorizer(access)

    # -- routes ----------------------------------------------------------------------------
    @app.post("/v1/score", summary="Score one step",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": SCORE_SCHEMA}}}},
              responses={200: {"description": "the event line `rewardstack score` writes, plus `sequence`"},
                         **_error_responses(400, 401, 403, 409, 413, 422, 429, 503, 504)})
    async def score(request: Request, scope: str | None = Depends(authorize)) -> Response:
        arrived = time.monotonic()
        code = 500
        try:
            response = await _score(request, scope, arrived)
            code = response.status_code
            return response
        except ServiceError as e:
            code = e.status
            raise
        finally:
            metrics.requests.labels(code=str(code)).inc()
            metrics.latency.observe(time.monotonic() - arrived)
            metrics.queue.set(worker.queue_length())

    async def _score(request: Request, scope: str | None, arrived: float) -> Response:
        body = await request.body()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ServiceError(400, "invalid_json", f"the body is not valid JSON: {e}", field="body") from None
        if not isinstance(obj, dict):
            raise ServiceError(422, "invalid_step", "a step must be a JSON object", field="body")
        namespace = namespace_for(obj.pop("namespace", None), scope)
        sequence = obj.pop("sequence", None)
        if sequence is not None and (not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1):
            raise ServiceError(422, "invalid_step", "field 'sequence': must be an integer >= 1", field="sequence")
        step = Step.from_dict(obj)  # the JSONL's validation: errors name the field
        check_limits(step, settings)
        if not worker.namespaces.known(namespace) and worker.namespaces.count() >= settings.max_namespaces:
            raise ServiceError(403, "namespace_limit", f"the service holds {settings.max_namespaces} namespaces "
                               "(service.max_namespaces); no new one can be made", field="namespace")
        deadline = arrived + min(settings.deadline_s, client_deadline(request))
        job = Job(namespace, step, sequence, deadline=deadline)
        worker.submit(job)  # 429 when full, 503 when not ready or draining
        outcome = await _wait(request, job, deadline)
        return Response(outcome.body, media_type="application/json",
                        headers={"X-Rewardstack-Scored": "true" if outcome.scored else "false"})

    async def _wait(request: Request, job: Job, deadline: float) -> Any:
        """The job's outcome; withdraws it if its deadline passes or its client goes away first."""
        result = asyncio.wrap_future(job.future)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({result, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if result in done:
                return result.result()
            if job.try_cancel():  # not started: it will never be scored
                if gone in done:
                    raise ServiceError(499, "client_gone", "the client went away; the step was not scored")
                raise ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring started; "
                                   "the step was not scored (service.deadline_s)")
            return await result  # started: it commits; answer with it
        finally:
            gone.cancel()

    @app.get("/v1/namespaces/{name}", summary="A namespace's committed sequence number",
             responses=_error_responses(401, 403, 422))
    async def namespace_info(name: str, scope: str | None = Depends(authorize)) -> dict:
        name = namespace_for(name, scope)
        sequence = await asyncio.to_thread(_sequence_of, worker, name)
        return {"namespace": name, "sequence": sequence, "next": sequence + 1}

    @app.get("/healthz", summary="Liveness: the worker's heartbeat, answered at once")
    async def healthz() -> JSONResponse:
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

    @app.get("/readyz", summary="Readiness: models loaded and a startup forward pass done; 503 while starting or draining")
    async def readyz() -> JSONResponse:
        if worker.ready:
            return JSONResponse({"status": "ready"})
        reason = ("failed: " + worker.error) if worker.error else ("draining" if worker.draining or worker.closed else "starting")
        return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "5"})

    @app.get("/v1/stack", summary="Models, placement, budget, cost models, queue", responses=_error_responses(401, 503))
    async def stack_info(scope: str | None = Depends(authorize)) -> dict:
        return describe(worker, config, settings)

    @app.get("/metrics", summary="Prometheus metrics", responses=_error_responses(401))
    async def metrics_route(scope: str | None = Depends(authorize)) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.queue.set(worker.queue_length())
        return Response(generate_latest(metrics_registry()), media_type=CONTENT_TYPE_LATEST)

    return app


DEADLINE_HEADER = "x-rewardstack-deadline-s"


def client_deadline(request: Request) -> float:
    """A client's own, shorter deadline in seconds (header `X-Rewardstack-Deadline-S`), else infinity."""
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return math.inf
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ServiceError(422, "invalid_request", f"header '{DEADLINE_HEADER}': must be a positive number of seconds",
                           field=DEADLINE_HEADER)
    return seconds


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def check_limits(step: Step, settings: ServiceSettings) -> None:
    """413 naming the field when the step is past a size limit (checked before any tokenization)."""
    if len(step.completions) > settings.max_completions:
        raise ServiceError(413, "too_many_completions", f"field 'completions': {len(step.completions)} completions, "
                           f"more than {settings.max_completions} (service.max_completions)", field="completions")
    fields = [("prompt", step.prompt), ("base_prompt", step.base_prompt)]
    fields += [(f"completions[{i}]", c) for i, c in enumerate(step.completions)]
    for name, text in fields:
        if text is not None and len(text) > settings.max_chars:
            raise ServiceError(413, "text_too_long", f"field '{name}': {len(text)} characters, more than "
                               f"{settings.max_chars} (service.max_chars)", field=name)


def _sequence_of(worker: Worker, name: str) -> int:
    """A namespace's committed sequence: from memory when loaded, else from its state file."""
    for ns in worker.namespaces.loaded():
        if ns.name == name:
            return ns.state.sequence
    from rewardstack.state import StateStore

    sections = StateStore(worker.namespaces.root / name).load()
    return int(sections.get("stack", {}).get("steps_scored", 0))


def describe(worker: Worker, config: StackConfig, settings: ServiceSettings) -> dict:
    """What `/v1/stack` shows: models and their placement, the budget, cost models, the queue."""
    stack = worker.stack
    if stack is None or not (worker.ready or worker.draining):
        raise ServiceError(503, "not_ready", "the models are still loading", headers={"Retry-After": "5"})
    for _ in range(3):  # the worker may be adding a cost model while this reads them
        try:
            summary = stack.memory.summary()
            break
        except RuntimeError:
            continue
    else:  # pragma: no cover - three collisions in a row
        summary = {}
    placement = (summary.get("placement") or {})
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
        "cost_models": summary.get("cost_models", {}),
        "queue": {"length": worker.queue_length(), "size": worker.queue.maxsize, "batch_requests": worker.batch_requests},
        "namespaces": sorted({ns.name for ns in worker.namespaces.loaded()} | set(worker.namespaces.on_disk())),
        "limits": {k: getattr(settings, k) for k in ("max_body_bytes", "max_completions", "max_chars", "deadline_s")},
        "steps_scored": worker.scored,
    }
