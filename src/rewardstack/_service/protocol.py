"""The scoring service's protocol: what `rewardstack serve` and the Ray Serve replicas both speak.

One module for the request and response contract of `POST /v1/score`, so the two servers cannot
drift (service/app.py on one worker, distributed/serve.py over state actors):

- the schemas for the OpenAPI document: `ScoreBody` (the step of `rewardstack._wire`, with
  `namespace` and `sequence`) whose JSON Schema is `SCORE_SCHEMA`, and `ERROR_SCHEMA`,
  `error_responses`;
- the body limit (`BodyLimit`, bytes counted as they arrive, and its timeout) and the size limits
  of a step (`check_limits`: completions, characters and work (`step_work`), before any
  tokenization);
- body parsing (`parse_score`): strict JSON through `rewardstack._jsonio` (bad UTF-8, bad syntax,
  `NaN`, nesting past 64 levels are all 400 `invalid_json`, never a 500), then the namespace, the
  sequence number and the step's own validation (422 naming the field);
- deadlines (`client_deadline`: the `X-Rewardstack-Deadline-S` header);
- the sequence rules: `response_body` (the answer), `stored_answer` / `answer_of` (what a
  namespace keeps of a committed step: its answer and the digest of the whole step as committed),
  `same_step` (is a repeat a retry of the committed step?), `sequence_conflict` and `sequence_gap`
  (409s), `repeat_answer` (a committed sequence sent again), `apply_step` (apply a forward result
  as the next sequence and keep its answer), `committed_sequence` (read from a state file);
- the namespace rules: `namespace_for` (which namespace a request may use: 422 for a malformed
  name, 403 for one its token is not bound to) and `namespace_limit` (403 past
  `service.max_namespaces`).

Every refusal is a `ServiceError`; the apps' handlers (service/guard.py) turn it into the body
`{"error": {"message", "type", "field"}}`. Nothing here imports FastAPI or Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import ConfigDict, Field, TypeAdapter

from rewardstack._fileio import event_line
from rewardstack.errors import InputError
from rewardstack._jsonio import MAX_DEPTH, JSONInputError, canonical_chunks, parse
from rewardstack._readview import ReadView
from rewardstack._service.errors import ServiceError
from rewardstack._service.namespaces import ALL_NAMESPACES, DEFAULT_NAMESPACE, NAME_RE, valid_name
from rewardstack._settings import InputSettings, ServiceSettings
from rewardstack.stack import ForwardResult, RewardState, opens_forward_pass
from rewardstack._stepresult import StepResult
from rewardstack._wire import ERROR_SCHEMA, RECENT_RESULTS, EventWire, Refuse, Step, StepWire, read

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


SCORE_SCHEMA: dict[str, Any] = ScoreBody.model_json_schema()
"""The OpenAPI schema of `POST /v1/score`'s body: every field a step accepts, `namespace` and `sequence`."""
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
        declared = None
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
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

@dataclass
class ScoreCall:
    """A parsed, admitted `POST /v1/score`: the namespace, its optional sequence number, the step."""

    namespace: str
    sequence: int | None
    step: Step


def parse_score(body: bytes, scope: str | None, settings: ServiceSettings,
                limits: InputSettings | None = None) -> ScoreCall:
    """The request body as a ScoreCall, or the ServiceError that refuses it (never anything else)."""
    try:
        obj = parse(body, strict=True)
    except JSONInputError as e:
        what = f"nested deeper than {MAX_DEPTH} levels" if e.reason == "depth" else str(e)
        raise ServiceError(400, "invalid_json", f"the body is not valid JSON: {what}; the step was not scored",
                           field="body") from None
    if not isinstance(obj, dict):
        raise ServiceError(422, "invalid_step", "a step must be a JSON object", field="body")
    namespace = namespace_for(obj.pop("namespace", None), scope)
    try:
        # The sequence is checked before the step, by its declaration in ScoreBody.
        sequence = read(_SEQUENCE, obj.pop("sequence", None), field="sequence", refuse=SEQUENCE_REFUSAL)
        step = Step.from_dict(obj)  # the JSONL's validation: errors name the field
    except InputError as e:
        raise ServiceError(422, "invalid_step", str(e), field=e.field) from None
    check_limits(step, settings, limits)
    return ScoreCall(namespace, sequence, step)


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


def namespace_limit(limit: int) -> ServiceError:
    """403: a new namespace past `service.max_namespaces`."""
    return ServiceError(403, "namespace_limit", f"the service holds {limit} namespaces (service.max_namespaces); "
                        "no new one can be made; the step was not scored", field="namespace")


# -- sequence rules ----------------------------------------------------------------------------

def response_body(event: dict[str, Any], sequence: int) -> str:
    """Exactly the event line `rewardstack score` writes, plus the sequence it was applied as."""
    line = event_line(event).rstrip("\n")
    assert line.endswith("}")
    return f'{line[:-1]}, "sequence": {sequence}}}'


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
(a repeat of the step is answered with the body alone)."""


def memory_header(memory: Mapping[str, Any]) -> str:
    """`memory_summary` as the header's value (ASCII JSON, no spaces)."""
    return json.dumps(dict(memory), allow_nan=False, default=str, separators=(",", ":"))


def _echo(step: Step) -> dict[str, Any]:
    """The step's fields as its event echoes them (what a retry of an answer kept without a digest
    must repeat exactly)."""
    n = len(step.completions)
    return {
        "name": step.name, "prompt": step.prompt,
        "base_prompt": step.base_prompt if step.base_prompt is not None else step.prompt, "completions": [c if c is not None else "" for c in step.completions],
        "uids": step.uids if step.uids is not None else list(range(n)),
        "completion_times": step.completion_times if step.completion_times is not None else [0.0] * n,
        "block": step.block, "gating_loss": step.gating_loss, "set_weights": step.set_weights,
    }


def step_digest(step: Step, max_chars: int | None = None) -> str:
    """SHA-256 of the step as committed: every field that changes what applying it does.

    The event cannot tell a retry from another step: it echoes a failed completion (`null`) and an
    empty one alike as `""`, and leaves out `new_forward_pass`. So the digest covers the step
    itself, with defaults made explicit (no base prompt is the prompt, no `new_forward_pass` is
    whether the step is `augment`, no uids are 0..n-1) so that two spellings of one step agree.
    `max_chars` (`[input] max_chars`): the step as read, each text cut there, as it was committed.
    """
    if max_chars is not None:
        step = ReadView.of(step, max_chars).step
    n = len(step.completions)
    whole = {
        "name": step.name, "prompt": step.prompt, "completions": list(step.completions),
        "base_prompt": step.base_prompt if step.base_prompt is not None else step.prompt,
        "new_forward_pass": opens_forward_pass(step),
        "uids": step.uids if step.uids is not None else list(range(n)),
        "completion_times": step.completion_times if step.completion_times is not None else [0.0] * n,
        "block": step.block, "gating_loss": step.gating_loss, "set_weights": step.set_weights,
        "logged_best": step.logged_best,
    }
    h = hashlib.sha256()
    for chunk in canonical_chunks(whole):  # a slice at a time: a 50 MB completion is not copied whole
        h.update(chunk)
    return h.hexdigest()


def stored_answer(body: str, step: Step, max_chars: int | None = None) -> str:
    """What a namespace keeps of committed step `step` for retries: its answer, a line break, and
    `step_digest`. The answer is one JSON line (the event writer escapes every line break in it),
    so the last line break always separates the two."""
    return f"{body}\n{step_digest(step, max_chars)}"


def answer_of(stored: str) -> str:
    """The answer to send for a kept step (`stored_answer`'s body; an older state kept the body alone)."""
    body, sep, _ = stored.rpartition("\n")
    return body if sep else stored


def same_step(stored: str, step: Step, max_chars: int | None = None) -> bool:
    """Whether a kept answer (`stored_answer`) is for this step (a retry), not another step reusing
    its number.

    `max_chars` (`[input] max_chars`): the committed step was read cut there. An answer kept by
    an older version has no digest: it is compared with the fields its event echoes.
    """
    body, sep, digest = stored.rpartition("\n")
    if sep:
        return digest == step_digest(step, max_chars)
    try:
        event = json.loads(stored)
    except ValueError:  # pragma: no cover - we wrote it
        return False
    if max_chars is not None:
        step = ReadView.of(step, max_chars).step
    want = json.loads(event_line(_echo(step)))  # through the event writer: NaN -> null, tuples -> lists
    return all(event.get(k) == v for k, v in want.items())


def sequence_conflict(namespace: str, got: int, expected: int) -> ServiceError:
    """409: `got` was committed with a different step."""
    return ServiceError(409, "sequence_conflict", f"sequence {got} of namespace '{namespace}' was committed with "
                        f"a different step; the next sequence is {expected}", field="sequence")


def sequence_gap(namespace: str, got: int, expected: int) -> ServiceError:
    """409: `got` is too old to have its result kept, or skips ahead of `expected`."""
    if got < expected:
        msg = (f"sequence {got} of namespace '{namespace}' was committed but its result is no longer kept "
               f"(only the last {RECENT_RESULTS} are); the next sequence is {expected}")
    else:
        msg = f"sequence {got} skips ahead: namespace '{namespace}' expects sequence {expected} next"
    return ServiceError(409, "sequence_gap", msg, field="sequence")


def repeat_answer(state: RewardState, namespace: str, sequence: int, step: Step, max_chars: int | None,
                  expected: int | None = None) -> str | ServiceError:
    """The answer to `step` sent again as `sequence`, which `state` has committed: the kept answer
    if it is the same step (a retry), else a 409 (`sequence_conflict` for another step,
    `sequence_gap` for one too old to be kept). `expected`: the next sequence the 409 names
    (default: the one after the state's; the service counts the steps of its batch too)."""
    expected = state.sequence + 1 if expected is None else expected
    stored = state.recent.get(sequence)
    if stored is None:
        return sequence_gap(namespace, sequence, expected)
    if not same_step(stored, step, max_chars):
        return sequence_conflict(namespace, sequence, expected)
    return answer_of(stored)


def apply_step(state: RewardState, fwd: ForwardResult) -> tuple[StepResult, str]:
    """Apply one forward result to a namespace's state as its next sequence number and keep the
    answer for retries (with the whole step's digest); the result and the answer's body. The
    caller commits the state to disk before it answers."""
    result = state.apply(fwd)
    body = response_body(result.event, state.sequence)
    state.remember(state.sequence, stored_answer(body, fwd.step))
    return result, body


def committed_sequence(folder: Path) -> int:
    """A namespace's committed sequence number, read from its state file (0 when it has none)."""
    from rewardstack._state import StateStore

    sections = StateStore(folder).load()
    return int(sections.get("stack", {}).get("steps_scored", 0))


__all__ = ["ANSWER_SCHEMA", "BodyLimit", "ScoreAnswer", "DEADLINE_HEADER", "ERROR_SCHEMA", "SCORE_CODES", "SCORE_SCHEMA", "ScoreBody", "ScoreCall", "check_limits",
           "answer_of", "apply_step", "client_deadline", "committed_sequence", "error_responses", "namespace_for", "namespace_limit",
           "parse_score", "repeat_answer", "response_body", "same_step", "score_responses", "sequence_conflict", "sequence_gap", "step_digest",
           "step_work", "stored_answer"]
