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
`service.max_work_chars` in all, counting every string a chat makes the models read (413 naming
the field; `/v1/models` lists them for clients). Malformed input is 422 naming the field: an
unknown field (with the closest known one), an empty text, a lone surrogate, each decided here
before the request joins a batch, so that it fails its own request only.

Tokenization follows each trainer's own server: `/get_reward` adds no special tokens (OpenRLHF's
serve_rm.py: the query is chat-templated, its BOS written in); `/classify` does as vLLM does (a
string gets them, a rendered chat does not; `add_special_tokens` overrides). Every answer is
counted in `rewardstack_service_requests_total{route, code}`.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from typing import Any, Iterator

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from rewardstack.errors import InputError
from rewardstack._models import USER_PREFIX
from rewardstack._service.batching import Scored, prepare_job
from rewardstack._service.edge import answer_of, as_service_error, authorize, require_json
from rewardstack._service.errors import ServiceError
from rewardstack._service.protocol import check_fields, client_deadline, json_object
from rewardstack._settings import ServiceSettings
from rewardstack._wire import is_valid_unicode


GET_REWARD_FIELDS = ("query", "prompts", "labels")
"""What OpenRLHF's `_fetch_rewards_via_http` sends (tests/trainer_clients.py)."""
CLASSIFY_FIELDS = ("model", "input", "messages", "use_activation", "activation", "softmax", "add_special_tokens",
                   "user", "request_id", "priority", "cache_salt")
"""vLLM's `/classify` fields that rewardstack honours (`activation` and `softmax` are vLLM's older
names of `use_activation`; verl sends `activation`) or that do not change a score (`user`,
`request_id`, `priority`, `cache_salt`)."""
DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "truncate_prompt_tokens": (None, -1), "truncation_side": (None,), "padding": (None, "do_not_pad"),
    "add_generation_prompt": (None, False), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {})}
"""vLLM's `/classify` fields that would change what is scored: accepted at their defaults only
(the length bound, truncation side and template are the `[rewards.*]` table's)."""


def _refuse(field: str, message: str) -> ServiceError:
    return ServiceError(422, "invalid_request", f"field '{field}': {message}", field=field)


def _texts(value: Any, field: str) -> tuple[list[str], list[str]]:
    """A list of strings (one string is a list of one) and each one's field name."""
    if isinstance(value, str):
        return [value], [field]
    if not isinstance(value, list) or not value:
        raise _refuse(field, "must be a string or a non-empty list of strings")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise _refuse(f"{field}[{i}]", f"must be a string, got {type(v).__name__}")
    return value, [f"{field}[{i}]" for i in range(len(value))]


def _chats(value: Any) -> tuple[list[list[dict]], list[str]]:
    """One chat (a list of messages) or a list of chats, each message `{"role": str, "content": str}`
    (other keys are the template's to read); and each chat's field name."""
    if not isinstance(value, list) or not value:
        raise _refuse("messages", "must be a non-empty list of messages, or of chats")
    one = isinstance(value[0], dict)
    chats, names = ([value], ["messages"]) if one else (value, [f"messages[{i}]" for i in range(len(value))])
    for chat, where in zip(chats, names):
        if not isinstance(chat, list) or not chat:
            raise _refuse(where, "must be a non-empty list of messages")
        for j, m in enumerate(chat):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _refuse(f"{where}[{j}]", 'must be {"role": string, "content": string}')
    return chats, names


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """Every string in an input with its place: a text, or a chat's keys and values (the template
    may read any of them)."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield where, k
            yield from _strings(v, f"{where}.{k}" if k.isidentifier() and len(k) <= 64 else where)


def _size(item: Any) -> int:
    """The characters an input makes the models read: every string of it, a chat's roles and keys too."""
    return len(item) if isinstance(item, str) else sum(len(s) for _, s in _strings(item, ""))


def _check_readable(items: list[Any], names: list[str]) -> None:
    """422 naming the first text no model can read (a lone surrogate) or that is empty: decided
    here, before the request joins a batch, so it fails its own request and no other."""
    for item, name in zip(items, names):
        if item == "":
            raise _refuse(name, "is empty: there is nothing to score")
        for where, text in _strings(item, name):
            if not is_valid_unicode(text):
                raise _refuse(where, "is not valid Unicode (it holds a lone surrogate)")


def _check_options(body: dict) -> None:
    """422 for a field of vLLM's that rewardstack does not carry out, sent with another value than its default."""
    for key, defaults in DEFAULTS_ONLY.items():
        value = body.get(key)
        if not any(value is d or (type(value) is type(d) and value == d) for d in defaults):
            shown = ", ".join("null" if d is None else json.dumps(d) for d in defaults)
            raise _refuse(key, f"{str(value)[:40]!r} is not supported: rewardstack takes only {shown} here (the length "
                          "bound, truncation side and chat template are the [rewards.*] table's)")


def _flag(body: dict, *keys: str) -> bool | None:
    """The first of `keys` the body sets (not null), which must be true or false; None when none is set."""
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise _refuse(key, "must be true or false")
            return value
    return None


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


def _check_limits(settings: ServiceSettings, items: list[Any], names: list[str], field: str, models: list[str]) -> None:
    """413 naming the field past `max_completions` inputs, `max_chars` per input or `max_work_chars`
    in all, counting every string an input makes the models read (`_size`)."""
    if len(items) > settings.max_completions:
        raise ServiceError(413, "too_many_inputs", f"field '{field}': {len(items)} inputs, more than "
                           f"{settings.max_completions} (service.max_completions)", field=field)
    sizes = [_size(item) for item in items]
    for size, name in zip(sizes, names):
        if size > settings.max_chars:
            raise ServiceError(413, "text_too_long", f"field '{name}': {size} characters, more than "
                               f"{settings.max_chars} (service.max_chars)", field=name)
    if sum(sizes) * len(models) > settings.max_work_chars:
        raise ServiceError(413, "too_much_work", f"field '{field}': the inputs ask the models to read more than "
                           f"{settings.max_work_chars} characters (service.max_work_chars)", field=field)


async def _run(request: Request, items: list[Any], names: list[str], field: str, models: list[str],
               special: bool | None) -> Scored:
    """Score `items` with `models` in the worker's next trainer slices, once each is known
    readable: tokenized here, on a thread of the app's pool, so a bad input fails this request
    alone (422 naming it) before it joins a slice, and the device's thread never tokenizes."""
    settings: ServiceSettings = request.app.state.settings
    _check_limits(settings, items, names, field, models)
    _check_readable(items, names)
    deadline = time.monotonic() + min(settings.trainer_deadline_s, client_deadline(request.headers))
    worker = request.app.state.worker
    worker.check_ready()
    try:
        job = await anyio.to_thread.run_sync(prepare_job, worker.stack, items, names, models, deadline, special)
    except InputError as e:
        raise ServiceError(422, "invalid_request", str(e), field=e.field) from None
    worker.submit(job)
    return await answer_of(request, job, deadline)


@contextlib.contextmanager
def _counted(request: Request, route: str) -> Iterator[None]:
    """Count the request in `rewardstack_service_requests_total` by route and the status it is answered with."""
    code = 500
    try:
        yield
        code = 200
    except Exception as e:
        code = as_service_error(e).status
        raise
    finally:
        request.app.state.metrics.requests.labels(route=route, code=str(code)).inc()


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
    with _counted(request, "/get_reward"):
        body = await _body_of(request)
        check_fields(body, GET_REWARD_FIELDS)
        if "query" not in body:
            raise _refuse("query", "missing: the chat-templated prompt+response texts to score")
        queries, names = _texts(body["query"], "query")
        for key in ("prompts", "labels"):
            value = body.get(key)
            if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
                raise _refuse(key, f"must be a list of one entry per query ({len(queries)}), got "
                              f"{len(value) if isinstance(value, list) else type(value).__name__}")
        models = _models_for(request, None)
        # OpenRLHF's convention (its serve_rm.py): a query is chat-templated already, its BOS written
        # in, so the tokenizer adds no special tokens.
        scored = await _run(request, queries, names, "query", models, special=False)
        rewards = _combined(request, scored, models)
        logs: dict[str, list[float]] = {n[len(USER_PREFIX):]: scored.scores[n] for n in models}
        logs["truncated"] = [float(t) for t in _truncated(scored)]
        return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


@router.post("/classify", summary="vLLM's classify: one score per input (verl's reward-model path)")
async def classify(request: Request, _scope: Any = Depends(authorize), _json: None = Depends(require_json)) -> dict:
    with _counted(request, "/classify"):
        body = await _body_of(request)
        check_fields(body, (*CLASSIFY_FIELDS, *DEFAULTS_ONLY))
        _check_options(body)
        models = _models_for(request, body.get("model"))
        if ("input" in body) == ("messages" in body):
            raise _refuse("input", "send exactly one of `input` (text or list of texts) and `messages`")
        field = "input" if "input" in body else "messages"
        items, names = _texts(body["input"], "input") if field == "input" else _chats(body["messages"])
        activation = _flag(body, "use_activation", "activation", "softmax")
        # vLLM's convention: a string gets the tokenizer's special tokens, a rendered chat does not,
        # unless the request says otherwise.
        scored = await _run(request, items, names, field, models, special=_flag(body, "add_special_tokens"))
        cut = _truncated(scored)
        data = []
        for i, score in enumerate(_combined(request, scored, models)):
            value = score if activation is False else 0.5 * (1.0 + math.tanh(score / 2))  # the sigmoid, without overflow
            data.append({"index": i, "label": "LABEL_0", "probs": [value], "num_classes": 1, "truncated": cut[i]})
        name = str(body.get("model") or "rewardstack")
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": data, "usage": {"prompt_tokens": scored.tokens, "total_tokens": scored.tokens}}


def _invariance(request: Request) -> dict[str, Any]:
    """Per served model, what its start-up check found (`scorers.invariance.Invariance`), once loaded."""
    stack = request.app.state.worker.stack
    scorers = stack.scorers if stack is not None else {}
    return {name: scorers[name].invariance.to_dict() for name in _members(request)
            if hasattr(scorers.get(name), "invariance")}


@router.get("/v1/models", summary="The served reward models (vLLM's list)")
async def list_models(request: Request, _scope: Any = Depends(authorize)) -> dict:
    settings: ServiceSettings = request.app.state.settings
    checked = _invariance(request)
    # What a request may hold (`_check_limits`), for clients to split their work by: inputs, characters
    # per input and characters in all, counted over the models a request scores with.
    limits = {"max_inputs": settings.max_completions, "max_chars": settings.max_chars,
              "max_work_chars": settings.max_work_chars}
    return {"object": "list", "data": [
        {"id": name[len(USER_PREFIX):], "object": "model", "created": 0, "owned_by": "rewardstack", "root": m.path,
         "max_model_len": m.max_length, "limits": limits, "same_input_same_score": checked.get(name)}
        for name, m in _members(request).items()]}


@router.get("/health", summary="vLLM's health check: 200 once the models are loaded")
async def health(request: Request) -> JSONResponse:
    checked = {name[len(USER_PREFIX):]: c for name, c in _invariance(request).items()}
    return JSONResponse({"same_input_same_score": checked} if checked else {},
                        status_code=200 if request.app.state.worker.ready else 503)
