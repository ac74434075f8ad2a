"""The scoring service's protocol: what `rewardstack serve` and the Ray Serve replicas both speak.

One module for the request and response contract of `POST /v1/score`, so the two servers cannot
drift (service/app.py on one worker, distributed/serve.py over state actors):

- the schemas for the OpenAPI document: `ScoreBody` (the step of `rewardstack._wire`, with
  `namespace`, `sequence` and `epoch`) whose JSON Schema is `SCORE_SCHEMA`, `SessionBody`, and
  `ERROR_SCHEMA`, `error_responses`;
- the body limit (`BodyLimit`, bytes counted as they arrive, and its timeout) and the size limits
  of a step (`check_limits`: completions, characters and work (`step_work`), before any
  tokenization);
- body parsing (`parse_score`): strict JSON through `rewardstack._fileio` (bad UTF-8, bad syntax,
  `NaN`, nesting past 64 levels are all 400 `invalid_json`, never a 500), an unknown field (422
  naming it and the closest known one: `check_fields`), then the namespace, the sequence number,
  the epoch and the step's own validation (422 naming the field); `parse_session`;
- deadlines (`client_deadline`: the `X-Rewardstack-Deadline-S` header);
- what an answer says of the step's memory (`memory_summary`, `MEMORY_HEADER`);
- `namespace_for`: which namespace a request may use (422 for a malformed name, 403 for one its
  token is not bound to; the 403 past `service.max_namespaces` is service/namespaces.py's).

Every refusal is a `ServiceError`; the apps' handlers (service/edge.py) turn it into the body
`{"error": {"message", "type", "field"}}`. The sequence and session rules are service/namespaces.py.
Nothing here imports FastAPI or Ray.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import time
from typing import Annotated, Any, Collection, Mapping

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rewardstack.errors import InputError
from rewardstack._fileio import JSONInputError, parse
from rewardstack._service.errors import ServiceError
from rewardstack._service.access import ALL_NAMESPACES
from rewardstack._service.namespaces import DEFAULT_NAMESPACE, NAME_RE, valid_name
from rewardstack._settings import InputSettings, ServiceSettings
from rewardstack._wire import ERROR_SCHEMA, EventWire, Refuse, Step, StepWire, read

SEQUENCE_REFUSAL = Refuse("must be an integer >= 1")
SequenceNumber = Annotated[int, Field(ge=1), SEQUENCE_REFUSAL]
"""A namespace's step number, from 1 (strict, as every field of `StepWire`)."""


class ScoreBody(StepWire):
    """The body of `POST /v1/score`: a step (`wire.StepWire`) and where it goes. Its JSON Schema is
    the route's OpenAPI request schema (`SCORE_SCHEMA`); `parse_score` reads the body through it."""

    model_config = ConfigDict(title="ScoreBody")

    namespace: Annotated[str | None, Field(pattern=f"^{NAME_RE.pattern}$", description=(
        f"the namespace whose state scores the step (default: the token's own, else {DEFAULT_NAMESPACE})"))] = None
    sequence: Annotated[SequenceNumber | None, Field(description="the namespace's step number; a repeat returns "
                                                     "the stored result")] = None
    epoch: Annotated[SequenceNumber | None, Field(description=(
        "the client's session on the namespace (`POST /v1/namespaces/{name}/sessions`); a step of an older "
        "session is refused as `fenced`"))] = None


class SessionBody(BaseModel):
    """The body of `POST /v1/namespaces/{name}/sessions`: who opens the session (shown to the client
    it fences)."""

    model_config = ConfigDict(strict=True, extra="forbid", title="SessionBody")

    client: Annotated[str, Field(max_length=200, description="the name the client gives itself")] = "unnamed"
    host: Annotated[str, Field(max_length=255, description="the client's host name")] = ""
    pid: Annotated[int | None, Field(ge=0, description="the client's process id")] = None


SCORE_SCHEMA: dict[str, Any] = ScoreBody.model_json_schema()
"""The OpenAPI schema of `POST /v1/score`'s body: every field a step accepts, `namespace`, `sequence`, `epoch`."""
SESSION_SCHEMA: dict[str, Any] = SessionBody.model_json_schema()
_SEQUENCE = TypeAdapter(SequenceNumber | None, config=ConfigDict(strict=True))


class ScoreAnswer(EventWire):  # type: ignore[valid-type, misc]
    """A score answer: the event (`wire.EventWire`) and the sequence number it was applied as."""

    model_config = ConfigDict(title="ScoreAnswer")

    sequence: Annotated[SequenceNumber, Field(description="the namespace's sequence number the step was applied as")]


ANSWER_SCHEMA: dict[str, Any] = ScoreAnswer.model_json_schema()
"""The OpenAPI schema of a score answer (`ScoreAnswer`)."""
SCORE_CODES = (400, 401, 403, 408, 409, 413, 415, 422, 429, 503, 504)
"""The error statuses `POST /v1/score` may answer."""
DEADLINE_HEADER = "x-rewardstack-deadline-s"


def score_responses() -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of `POST /v1/score`: the answer's schema and every error status's."""
    return {200: {"description": "the event line `rewardstack score` writes, plus `sequence`",
                  "content": {"application/json": {"schema": ANSWER_SCHEMA}}}, **error_responses(*SCORE_CODES)}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses, each with the error body's schema."""
    return {c: {"description": "error", "content": {"application/json": {"schema": ERROR_SCHEMA}}} for c in codes}


# -- request size, counted as the bytes arrive ------------------------------------------------

class BodyLimit:
    """Pure ASGI middleware: a body past `limit` bytes raises ServiceError(413) from `receive`, and
    a body not complete `body_timeout_s` after its headers raises ServiceError(408).

    The count is of bytes received, so a chunked body or a lying Content-Length cannot get past
    it; a declared Content-Length over the limit fails at the first read without waiting for the
    bytes. The timeout is for the whole body, not per read: a client sending a byte a second
    never waits long between reads, yet holds its connection forever. Raising from `receive`
    puts the error inside the route, where the app's exception handlers answer it like every
    other error.
    """

    def __init__(self, app: Any, limit: int, body_timeout_s: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length", b"").strip()
        declared = int(length) if length.isdigit() else None
        received = 0
        limit = self.limit
        timeout = self.body_timeout_s
        started = time.monotonic()  # the headers are complete when the app is called
        body_done = False

        def too_large() -> ServiceError:
            return ServiceError(413, "body_too_large", f"the request body is larger than {limit} bytes "
                                "(service.max_body_bytes)", field="body")

        def too_slow() -> ServiceError:
            return ServiceError(408, "body_timeout", f"the request body did not arrive within {timeout:g} s "
                                "(service.body_timeout_s); the step was not scored", field="body",
                                headers={"Connection": "close"})

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if declared is not None and declared > limit:
                raise too_large()
            if body_done or timeout is None:  # after the body, a read waits for the disconnect: no limit
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, started + timeout - time.monotonic()))
                except TimeoutError:
                    raise too_slow() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large()
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)


def namespace_for(requested: Any, scope: str | None) -> str:
    """The namespace a request asked for (its token's, or `default`, when it names none); 422 for a
    malformed name, 403 for one its token is not bound to."""
    if requested is None:
        requested = scope if scope not in (None, ALL_NAMESPACES) else DEFAULT_NAMESPACE
    if not valid_name(requested):
        raise ServiceError(422, "invalid_step", f"field 'namespace': must match {NAME_RE.pattern}", field="namespace")
    if scope not in (None, ALL_NAMESPACES) and requested != scope:
        raise ServiceError(403, "forbidden", f"this token may only use namespace '{scope}'", field="namespace")
    return requested


# -- a score request ---------------------------------------------------------------------------

def parse_score(body: bytes, scope: str | None, settings: ServiceSettings,
                limits: InputSettings | None = None) -> tuple[str, int | None, int | None, Step]:
    """The request body as its namespace, sequence number, epoch and step, or the ServiceError that
    refuses it (never anything else)."""
    obj = json_object(body, "invalid_step", "a step must be a JSON object", "; the step was not scored")
    check_fields(obj, ScoreBody)
    namespace = namespace_for(obj.pop("namespace", None), scope)
    try:
        # The sequence and the epoch are checked before the step, by their declarations in ScoreBody.
        sequence = read(_SEQUENCE, obj.pop("sequence", None), field="sequence", refuse=SEQUENCE_REFUSAL)
        epoch = read(_SEQUENCE, obj.pop("epoch", None), field="epoch", refuse=SEQUENCE_REFUSAL)
        step = Step.from_dict(obj)  # the JSONL's validation: errors name the field
    except InputError as e:
        raise ServiceError(422, "invalid_step", str(e), field=e.field) from None
    check_limits(step, settings, limits)
    return namespace, sequence, epoch, step


def json_object(body: bytes, kind: str, not_object: str, more: str = "") -> dict:
    """The body as a JSON object: 400 `invalid_json` saying why it is not strict JSON of bounded
    nesting (`_fileio.parse`; `more` ends the message), 422 `kind` saying `not_object` when it is
    JSON but no object."""
    try:
        obj = parse(body, strict=True)
    except JSONInputError as e:
        raise ServiceError(400, "invalid_json", f"the body is not valid JSON: {e}{more}", field="body") from None
    if not isinstance(obj, dict):
        raise ServiceError(422, kind, not_object, field="body")
    return obj


def check_fields(obj: Mapping[str, Any], schema: type[BaseModel] | Collection[str]) -> None:
    """422 naming the first field `schema` (a model, or the names themselves) does not declare, and the
    declared field closest to it: a misspelt `sequnce` must not leave a step unnumbered, nor
    `base_promt` be ignored, nor `use_activaton: false` give the sigmoid."""
    known = list(schema.model_fields) if isinstance(schema, type) else list(schema)
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; the fields are {', '.join(known)}"
            raise ServiceError(422, "unknown_field", f"field '{key}' is not a field of this request{hint}",
                               field=str(key)[:200])


def parse_session(body: bytes) -> SessionBody:
    """`POST /v1/namespaces/{name}/sessions`' body (empty: an unnamed client), or the ServiceError."""
    obj = json_object(body, "invalid_request", "the body must be a JSON object") if body.strip() else {}
    check_fields(obj, SessionBody)
    try:
        return SessionBody.model_validate(obj)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        field = str(error["loc"][0]) if error["loc"] else "body"
        raise ServiceError(422, "invalid_request", f"field '{field}': {error['msg']}", field=field) from None


def step_work(step: Step) -> int:
    """The work a step asks of the models, in characters they read: each live (not failed)
    completion with its prompt, and with its base prompt when one is given (the masks read it).

    A measure known before tokenizing, which grows with what the forward passes cost: the texts'
    lengths times how many completions read them (`service.max_work_chars` caps it).
    """
    live = [c for c in step.completions if c is not None]
    per = len(step.prompt) + (len(step.base_prompt) if step.base_prompt is not None else 0)
    return len(live) * per + sum(len(c) for c in live)


def check_limits(step: Step, settings: ServiceSettings, limits: InputSettings | None = None) -> None:
    """413 naming the field when the step is past a size limit (checked before any tokenization).

    The service refuses what the library would cut: `service.max_chars` and the smaller of
    `service.max_completions` and `[input] max_completions`; and a step whose work
    (`step_work`) is past `service.max_work_chars`, so that no single request holds the one
    worker for long.
    """
    most = settings.max_completions if limits is None else min(settings.max_completions, limits.max_completions)
    if len(step.completions) > most:
        raise ServiceError(413, "too_many_completions", f"field 'completions': {len(step.completions)} completions, "
                           f"more than {most} (service.max_completions)", field="completions")
    fields = [("prompt", step.prompt), ("base_prompt", step.base_prompt)]
    fields += [(f"completions[{i}]", c) for i, c in enumerate(step.completions)]
    for name, text in fields:
        if text is not None and len(text) > settings.max_chars:
            raise ServiceError(413, "text_too_long", f"field '{name}': {len(text)} characters, more than "
                               f"{settings.max_chars} (service.max_chars)", field=name)
    work = step_work(step)
    if work > settings.max_work_chars:
        raise ServiceError(413, "too_much_work", f"field 'completions': the step asks the models to read {work} "
                           f"characters (each live completion with its prompt and base prompt), more than "
                           f"{settings.max_work_chars} (service.max_work_chars); send fewer or shorter texts",
                           field="completions")


def client_deadline(headers: Mapping[str, str]) -> float:
    """A client's own, shorter deadline in seconds (header `X-Rewardstack-Deadline-S`), else infinity."""
    value = headers.get(DEADLINE_HEADER)
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


# -- the memory record of an answer -------------------------------------------------------

def memory_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a score answer says (in `MEMORY_HEADER`) of the step's memory record (bytes; null where nothing measured it).

    Per model the peak of its calls, the step's peak, the OOMs its calls recovered from (split,
    CPU fallback) or lost, the swaps and the weights on the card, the allocator's figures at rest.
    The per-model figures need the telemetry monitor (`serve` with a run directory).
    """
    rest = record.get("rest") or {}
    card = record.get("card") or {}
    return {
        "step": record.get("step"),
        "peak_bytes": record.get("peak_bytes"),
        "models": {name: m.get("peak_bytes") for name, m in (record.get("models") or {}).items()},
        "ooms": record.get("ooms"),
        "swaps": card.get("swaps"),
        "weights_on_card_bytes": card.get("weights_on_card"),
        "allocated_bytes": rest.get("allocated"),
        "reserved_bytes": rest.get("reserved"),
        "budget_bytes": record.get("budget_bytes"),
    }


MEMORY_HEADER = "X-Rewardstack-Memory"
"""The header of a scored answer that carries `memory_summary` of its step, as compact JSON. A
header, as TGI sends its per-request timings, so that the body stays the kept answer byte for byte
(a retry of the step gets the same body, and the record kept with it)."""
