"""What crosses the wire: the step in, the event and the error out; one declaration of each.

`StepWire` (pydantic v2) is the step as a JSONL line of `rewardstack score` and the body of the
service's `POST /v1/score` carry it; `Step` is the dataclass the stack scores, made from it at the
edge (`Step.from_dict`) and written back in its shape (`Step.to_dict`). Everything that reads a step
goes through here: `score`'s and replay's readers, the service's `parse_score` and through it Ray
Serve's route; the service's OpenAPI schema is `StepWire`'s JSON Schema (service/protocol.py adds
`namespace` and `sequence`). The Python client (clients/python) does not import this module: it
stays httpx-only, sends plain dicts and leaves validation to the service.

Out: `EventWire`, the event `score` writes and the service answers (its OpenAPI 200 schema), and
`ErrorWire` / `error_body` / `ERROR_SCHEMA`, the body of every error answer.

A refusal is one `InputError` naming the line and the field, with the message each field declares
(`Refuse`): the first error in the order the checks have always run (a missing required field,
then a required text that is not a string, then the fields in declaration order, then the texts'
Unicode), so `score` and the service report what they always did.

Also here, because they are rules of the wire too: the task names (`TASK_RE`), the
`[input] max_completions` check (`check_completions`) and the retry window, how many committed
answers a namespace keeps for a repeated sequence number (`RECENT_RESULTS`, `RECENT_BYTES`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any, Mapping

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from rewardstack.errors import InputError
from rewardstack._models import ALL_MODELS

TASK_RE = re.compile(r"augment|followup[0-9]*|answer[0-9]*")
"""The task names a step may have (spec: `augment`, `followupN`, `answerN`; replay's v1.0 rows: no N)."""

RECENT_RESULTS = 64
"""How many committed results a state keeps for retried requests (by sequence number)."""
RECENT_BYTES = 64 * 2**20
"""At most this many bytes of kept results (UTF-8): a state holds 64 small answers, or fewer large
ones (the newest always), so what it keeps of texts is bounded whatever the steps hold."""

WIRE_ERROR = "rewardstack_step"
"""The pydantic error type of this module's own checks; its message is the refusal as written."""


class Refuse:
    """A field's refusal message (Annotated metadata; pydantic ignores it, `read` reads it).

    `message` answers any error of the field; `by_type` answers particular pydantic error types.
    Both may name `{type}` (the type of what was sent) and `{got}` (its first 40 characters).
    """

    def __init__(self, message: str, **by_type: str) -> None:
        self.message = message
        self.by_type = by_type

    def says(self, error: Mapping[str, Any]) -> str:
        value = error.get("input")
        text = self.by_type.get(error["type"], self.message)
        return text.format(type=type(value).__name__, got=value[:40] if isinstance(value, str) else value)


def _wire_error(message: str, field: str | None = None) -> PydanticCustomError:
    """An error raised by a check of this module, with its refusal as written (and its field
    where that is not the field being validated: `completions[3]`)."""
    return PydanticCustomError(WIRE_ERROR, message, {"field": field} if field else None)


# A strict union keeps each value's own type: 1 stays 1, True stays True; null is a weight
# inside a list (as the validator logs a missing one).
Weight = bool | int | float


class StepWire(BaseModel):
    """One validator step on the wire: a JSONL line of `score`, the body of `POST /v1/score`.

    The fields in the order their checks have always run. `failed` is wire only: it marks the
    completions that become `None` in `Step`. Unknown keys are ignored. Lists stop at their first
    bad item (`fail_fast`): a hostile million-item list is one error, not a million.
    """

    model_config = ConfigDict(strict=True, extra="ignore", title="Step")

    name: Annotated[str, Field(pattern=f"^(?:{TASK_RE.pattern})$", description="augment, followupN or answerN"),
                    Refuse("must be augment, followupN or answerN, got {got!r}", string_type="must be a string, got {type}")]
    prompt: Annotated[str, Refuse("must be a string, got {type}")]
    completions: Annotated[list[str | None], Field(fail_fast=True, description="null marks a failed response (not scored)"),
                           Refuse("must be a list of strings (null marks a failed response)")]
    base_prompt: Annotated[str | None, Field(description="what the masks compare against (default: prompt)"),
                           Refuse("must be a string")] = None
    uids: Annotated[list[int] | None, Field(fail_fast=True, description="one per completion (default: 0..n-1)"),
                    Refuse("must be a list of integers")] = None
    completion_times: Annotated[list[float] | None, Field(fail_fast=True, description="seconds, one per completion"),
                                Refuse("must be a list of numbers")] = None
    failed: Annotated[list[bool] | None, Field(fail_fast=True, description="true marks a failed response, one per completion"),
                      Refuse("must be a list of booleans, one per completion")] = None
    new_forward_pass: Annotated[bool | None, Field(description="whether this step opens a validator forward pass "
                                                   "(default: the augment step does)"),
                                Refuse("must be true or false")] = None
    block: Annotated[int | None, Field(ge=0), Refuse("must be a non-negative integer")] = None
    gating_loss: Annotated[int | float | None, Refuse("must be a number")] = None
    set_weights: Annotated[Weight | list[Weight | None | list[Weight | None]] | None,
                           Field(description="a number, a boolean, or a list (of lists) of numbers"),
                           Refuse("must be a number, a boolean, or a list (of lists) of numbers")] = None
    logged_best: Annotated[str | None, Field(description="the best a recorded run logged for this step (replay)"),
                           Refuse("must be a string")] = None

    @field_validator("uids", "completion_times", "failed")
    @classmethod
    def _one_per_completion(cls, value: list | None, info: ValidationInfo) -> list | None:
        comps = info.data.get("completions")  # absent when the completions were refused already
        if value is not None and comps is not None and len(value) != len(comps):
            raise _wire_error("must be a list of booleans, one per completion" if info.field_name == "failed"
                              else f"has {len(value)} entries for {len(comps)} completions")
        return value

    @model_validator(mode="after")
    def _valid_unicode(self) -> "StepWire":
        # Checked last, on what is scored (a failed completion is dropped): JSON can carry a lone
        # surrogate (\ud800) that UTF-8, and so every tokenizer and the event writer, cannot.
        failed = self.failed or [False] * len(self.completions)
        texts = [("prompt", self.prompt), ("base_prompt", self.base_prompt)]
        texts += [(f"completions[{i}]", c) for i, (c, f) in enumerate(zip(self.completions, failed)) if not f]
        for field, text in texts:
            if text is not None and not is_valid_unicode(text):
                raise _wire_error("is not valid Unicode (it holds a lone surrogate)", field)
        return self


def is_valid_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (lone surrogates such as \\ud800)."""
    if text.isascii():  # no copy of a huge ASCII text just to check it
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _order(error: Mapping[str, Any], required: set[str]) -> int:
    """When a refusal is reported, as the hand-written checks before this module ran them: a
    missing field first, then a required text that is not a string, then the rest in field order."""
    if error["type"] == "missing":
        return 0
    loc = tuple(error["loc"])
    return 1 if error["type"] == "string_type" and len(loc) == 1 and loc[0] in required else 2


def read(schema: type[BaseModel] | TypeAdapter, value: Any, *, field: str | None = None,
         refuse: Refuse | None = None, line: int | None = None) -> Any:
    """`value` validated by `schema` (a model, or one field's `TypeAdapter` named `field` with its
    `refuse`); an `InputError` naming the line and the field of the first error otherwise."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_python(value)
        return schema.model_validate(value)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    required = {n for n, f in schema.model_fields.items() if f.is_required()} if isinstance(schema, type) else set()
    error = min(errors, key=lambda err: _order(err, required))  # among equals, the first in field order
    name = str(error["loc"][0]) if error["loc"] else field
    if error["type"] == "missing":
        message = "missing"
    elif error["type"] == WIRE_ERROR:
        message = error["msg"]
        name = (error.get("ctx") or {}).get("field", name)
    else:
        if refuse is None and isinstance(schema, type):
            refuse = next(m for m in schema.model_fields[name].metadata if isinstance(m, Refuse))
        message = refuse.says(error) if refuse is not None else error["msg"]
    raise InputError(message, line=line, field=name)


@dataclass
class Step:
    """One validator step. `completions[i] is None` marks a failed response (not scored)."""

    name: str
    prompt: str
    completions: list[str | None]
    base_prompt: str | None = None
    uids: list[int] | None = None
    completion_times: list[float] | None = None
    block: int | None = None
    gating_loss: float | None = None
    set_weights: Any = None
    new_forward_pass: bool | None = None
    """Whether this step opens a validator forward pass (default: the `augment` step does)."""
    logged_best: str | None = None
    """The `best` a recorded run logged for this step (replay): the blacklist records it instead of the stack's own best."""

    def resolved(self) -> dict[str, Any]:
        """The fields whose absence means a default, made explicit (the one place they are filled):
        the masks' base prompt (the prompt), the uids (0..n-1), the completion times (0.0 each),
        whether the step opens a forward pass (the `augment` step does)."""
        n = len(self.completions)
        return {
            "base_prompt": self.base_prompt if self.base_prompt is not None else self.prompt,
            "uids": self.uids if self.uids is not None else list(range(n)),
            "completion_times": self.completion_times if self.completion_times is not None else [0.0] * n,
            "new_forward_pass": self.new_forward_pass if self.new_forward_pass is not None else self.name == "augment",
        }

    def as_read(self, max_chars: int) -> "Step":
        """The step as the models read it, every text cut to `max_chars` (`[input] max_chars`): what
        the forward pass scores, and what a committed step's digest covers."""
        def cut(text: str | None) -> str | None:
            return text[:max_chars] if text is not None and len(text) > max_chars else text

        if all(t is None or len(t) <= max_chars for t in (self.prompt, self.base_prompt, *self.completions)):
            return self
        return dataclasses.replace(self, prompt=cut(self.prompt), base_prompt=cut(self.base_prompt),
                                   completions=[cut(c) for c in self.completions])

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form `rewardstack score` reads (`StepWire`'s shape; fields left unset are left out)."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None or StepWire.model_fields[f.name].is_required():
                d[f.name] = list(value) if isinstance(value, list) else value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, line: int | None = None) -> "Step":
        """Validate a JSON object into a Step (through `StepWire`); errors name the line and field."""
        if not isinstance(d, Mapping):
            raise InputError("a step must be a JSON object", line=line)
        wire: StepWire = read(StepWire, d if isinstance(d, dict) else dict(d), line=line)
        fields = dict(wire)  # the validated values as they are (no copy), less the wire-only `failed`
        failed = fields.pop("failed") or [False] * len(wire.completions)
        # Completions arrive stripped in the validator; strip here so every scorer agrees.
        fields["completions"] = [None if f or c is None else c.strip() for c, f in zip(wire.completions, failed)]
        fields["logged_best"] = wire.logged_best.strip() if wire.logged_best is not None else None
        return cls(**fields)


# -- what goes back out: the event and the error -------------------------------------------------

Value = float | None
"""A model's value for one completion: null where it was not scored (the status says why)."""


def _event_fields() -> dict[str, Any]:
    """The event's fields: the spec's, then two per model in the registry (raw and normalized)."""
    fields: dict[str, Any] = {
        "name": (str, ...), "block": (int | None, ...), "gating_loss": (float | None, ...),
        "uids": (list[int], ...), "prompt": (str, ...),
        "base_prompt": (str, Field(description="the masks' base prompt as scored (the prompt when the step gave none)")),
        "step_length": (float, Field(description="seconds the step took")),
        "best": (str, Field(description="the completion with the highest reward (\"\" when none was scored)")),
        "completions": (list[str], Field(description="as scored (a failed one is \"\")")),
        "completion_times": (list[float], ...), "rewards": (list[Value], ...),
        "set_weights": (Any, ...),
    }
    for name in ALL_MODELS:
        fields[name] = (list[Value], Field(description=f"{name}: raw values, one per completion"))
        fields[name + "_normalized"] = (list[Value], Field(description=f"{name}: normalized values"))
    fields["statuses"] = (list[str], Field(description="one per completion: the most severe over the models"))
    fields["model_statuses"] = (dict[str, list[str]], Field(description="per active model, one per completion"))
    return fields


EventWire: type[BaseModel] = create_model(
    "Event", __config__=ConfigDict(extra="allow", title="Event"), __doc__=(
        "One scored step as `rewardstack score` writes it (a JSONL line; `step_hash` added) and the "
        "service answers it (`sequence` added); NaN is written as null."), **_event_fields())
"""The event's schema (`stack.build_event` makes the dict): the service's 200 answer in its OpenAPI
document, and what a test holds a real event to."""


class ErrorWire(BaseModel):
    """One refusal, the `error` of an error answer's body `{"error": {...}}`."""

    model_config = ConfigDict(title="Error")

    message: str = Field(description="what was wrong, and whether the step was scored")
    type: str = Field(description="machine-readable kind: invalid_step, sequence_gap, queue_full, ...")
    field: str | None = Field(None, description="the request field at fault, when one is")


def error_body(message: str, type: str, field: str | None = None) -> dict[str, Any]:
    """An error answer's JSON body, `{"error": {"message", "type", "field"}}` (`ErrorWire`)."""
    return {"error": ErrorWire(message=message, type=type, field=field).model_dump()}


ERROR_SCHEMA: dict[str, Any] = {"type": "object", "title": "ErrorBody", "required": ["error"],
                                "properties": {"error": ErrorWire.model_json_schema()}}
"""The JSON Schema of an error answer's body (inline: OpenAPI documents reference no `$defs`)."""


def check_completions(step: Step, limit: int, *, line: int | None = None) -> None:
    """InputError naming `completions` when `step` has more than `limit` (`[input] max_completions`)."""
    if len(step.completions) > limit:
        raise InputError(f"{len(step.completions)} completions, more than {limit} ([input] max_completions)",
                         line=line, field="completions")
