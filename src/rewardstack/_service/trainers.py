"""The stateless routes RLHF trainers call, in the shapes they send (docs/TRAINERS.md).

- `POST /get_reward` (OpenRLHF's `--remote_rm_url`): `{"query": [text, ...], "prompts", "labels"}`
  -> `{"rewards", "scores", "extra_logs"}`, each member model's scores and `truncated` (1.0 for an
  input cut at a model's length bound) in `extra_logs`, one value per query;
- `POST /classify` (vLLM's, which verl's reward-model path calls): `{"model", "input": text or list,
  "use_activation"}` or `{"messages": chat or list of chats}` -> `{"data": [{"probs": [score]}, ...]}`;
- `GET /v1/models`, `GET /health` (vLLM's).

They score with the `[rewards.*]` models only, through the worker's lane (service/batching.py),
and touch no namespace. `rewards` are the sum over members of weight x score (the raw first logit;
`/classify` applies a sigmoid unless `use_activation`/`activation` is false, as vLLM does).
Bearer tokens, the loopback guard, the body limit and timeout are the app's, as for `/v1/score`;
the size limits are `service.max_completions` inputs, `service.max_chars` per text and
`service.max_work_chars` in all (413 naming the field). Malformed input is 422 naming the field.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from rewardstack.errors import InputError
from rewardstack._models import USER_PREFIX
from rewardstack._service.batching import Scored, prepare_job
from rewardstack._service.edge import answer_of, authorize, require_json
from rewardstack._service.errors import ServiceError
from rewardstack._service.protocol import client_deadline, json_object
from rewardstack._settings import ServiceSettings


def _refuse(field: str, message: str) -> ServiceError:
    return ServiceError(422, "invalid_request", f"field '{field}': {message}", field=field)


def _texts(value: Any, field: str) -> list[str]:
    """A list of strings (one string is a list of one)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise _refuse(field, "must be a string or a non-empty list of strings")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise _refuse(f"{field}[{i}]", f"must be a string, got {type(v).__name__}")
    return value


def _chats(value: Any) -> list[list[dict]]:
    """One chat (a list of messages) or a list of chats, each message `{"role": str, "content": str}`."""
    if not isinstance(value, list) or not value:
        raise _refuse("messages", "must be a non-empty list of messages, or of chats")
    chats = [value] if isinstance(value[0], dict) else value
    for i, chat in enumerate(chats):
        where = "messages" if chats is not value else f"messages[{i}]"
        if not isinstance(chat, list) or not chat:
            raise _refuse(where, "must be a non-empty list of messages")
        for j, m in enumerate(chat):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _refuse(f"{where}[{j}]", 'must be {"role": string, "content": string}')
    return chats


def _size(item: Any) -> int:
    return len(item) if isinstance(item, str) else sum(len(m["content"]) for m in item)


router = APIRouter(tags=["trainers"])
"""The trainer routes, which service/app.py includes: plain functions that find the config, settings
and worker on `request.app.state`."""


def _members(request: Request) -> dict[str, Any]:
    """The served `[rewards.*]` models by their full name (`rewards.<name>`)."""
    return {m.name: m for m in request.app.state.config.user_rewards()}


def _models_for(request: Request, model: Any) -> list[str]:
    """The models a request scores with: the one it names (its table's name, full name or path), or all."""
    members = _members(request)
    if model is None:
        if not members:
            raise ServiceError(404, "no_reward_models", "this service's config names no [rewards.*] model, "
                               "which the trainer routes score with", field="model")
        return list(members)
    for name, m in members.items():
        if model in (name[len(USER_PREFIX):], name, m.path):
            return [name]
    served = ", ".join(n[len(USER_PREFIX):] for n in members) or "none"
    raise ServiceError(404, "model_not_found", f"field 'model': no served reward model {str(model)[:100]!r}; "
                       f"this service serves {served}", field="model")


async def _body_of(request: Request) -> dict:
    return json_object(await request.body(), "invalid_request", "field 'body': must be a JSON object")


def _check_limits(settings: ServiceSettings, items: list[Any], field: str, models: list[str]) -> None:
    """413 naming the field past `max_completions` inputs, `max_chars` per input or `max_work_chars` in all."""
    if len(items) > settings.max_completions:
        raise ServiceError(413, "too_many_inputs", f"field '{field}': {len(items)} inputs, more than "
                           f"{settings.max_completions} (service.max_completions)", field=field)
    for i, item in enumerate(items):
        if _size(item) > settings.max_chars:
            raise ServiceError(413, "text_too_long", f"field '{field}[{i}]': {_size(item)} characters, more than "
                               f"{settings.max_chars} (service.max_chars)", field=f"{field}[{i}]")
    if sum(map(_size, items)) * len(models) > settings.max_work_chars:
        raise ServiceError(413, "too_much_work", f"field '{field}': the inputs ask the models to read more than "
                           f"{settings.max_work_chars} characters (service.max_work_chars)", field=field)


async def _run(request: Request, items: list[Any], field: str, models: list[str]) -> Scored:
    """Score `items` with `models` in the worker's next trainer slices: tokenized here, on a thread
    of the app's pool, so a bad input fails this request alone (422 naming it) before it joins a
    slice, and the device's thread never tokenizes."""
    settings: ServiceSettings = request.app.state.settings
    _check_limits(settings, items, field, models)
    deadline = time.monotonic() + min(settings.trainer_deadline_s, client_deadline(request.headers))
    worker = request.app.state.worker
    worker.check_ready()
    try:
        job = await anyio.to_thread.run_sync(prepare_job, worker.stack, items, field, models, deadline)
    except InputError as e:
        raise ServiceError(422, "invalid_request", str(e), field=e.field) from None
    worker.submit(job)
    return await answer_of(request, job, deadline)


def _combined(request: Request, scored: Scored, models: list[str]) -> list[float]:
    """Each input's reward: the weighted sum over the models (a lone model's score as it is)."""
    members = _members(request)
    n = len(next(iter(scored.scores.values())))
    weights = {m: members[m].weight for m in models} if len(models) > 1 else {models[0]: 1.0}
    return [sum(weights[m] * scored.scores[m][i] for m in models) for i in range(n)]


def _truncated(scored: Scored) -> list[bool]:
    return [any(flags) for flags in zip(*scored.truncated.values())]


@router.post("/get_reward", summary="OpenRLHF's remote reward model: rewards of chat-templated texts")
async def get_reward(request: Request, _scope: Any = Depends(authorize), _json: None = Depends(require_json)) -> dict:
    body = await _body_of(request)
    if "query" not in body:
        raise _refuse("query", "missing: the chat-templated prompt+response texts to score")
    queries = _texts(body["query"], "query")
    for key in ("prompts", "labels"):
        value = body.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
            raise _refuse(key, f"must be a list of one entry per query ({len(queries)}), got "
                          f"{len(value) if isinstance(value, list) else type(value).__name__}")
    models = _models_for(request, None)
    scored = await _run(request, queries, "query", models)
    rewards = _combined(request, scored, models)
    logs: dict[str, list[float]] = {n[len(USER_PREFIX):]: scored.scores[n] for n in models}
    logs["truncated"] = [float(t) for t in _truncated(scored)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


@router.post("/classify", summary="vLLM's classify: one score per input (verl's reward-model path)")
async def classify(request: Request, _scope: Any = Depends(authorize), _json: None = Depends(require_json)) -> dict:
    body = await _body_of(request)
    models = _models_for(request, body.get("model"))
    if ("input" in body) == ("messages" in body):
        raise _refuse("input", "send exactly one of `input` (text or list of texts) and `messages`")
    items: list[Any] = _texts(body["input"], "input") if "input" in body else _chats(body["messages"])
    activation = body.get("use_activation", body.get("activation", True))
    if activation is None:
        activation = True
    if not isinstance(activation, bool):
        raise _refuse("use_activation", "must be true or false")
    scored = await _run(request, items, "input" if "input" in body else "messages", models)
    cut = _truncated(scored)
    data = []
    for i, score in enumerate(_combined(request, scored, models)):
        value = 0.5 * (1.0 + math.tanh(score / 2)) if activation else score  # the sigmoid, without overflow
        data.append({"index": i, "label": "LABEL_0", "probs": [value], "num_classes": 1, "truncated": cut[i]})
    name = str(body.get("model") or "rewardstack")
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
            "data": data, "usage": {"prompt_tokens": scored.tokens, "total_tokens": scored.tokens}}


@router.get("/v1/models", summary="The served reward models (vLLM's list)")
async def list_models(request: Request, _scope: Any = Depends(authorize)) -> dict:
    return {"object": "list", "data": [
        {"id": name[len(USER_PREFIX):], "object": "model", "created": 0, "owned_by": "rewardstack", "root": m.path,
         "max_model_len": m.max_length} for name, m in _members(request).items()]}


@router.get("/health", summary="vLLM's health check: 200 once the models are loaded")
async def health(request: Request) -> JSONResponse:
    return JSONResponse({}, status_code=200 if request.app.state.worker.ready else 503)
