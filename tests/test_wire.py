"""The wire schema (`rewardstack._wire`) and the `Step` the stack scores cannot drift apart: every
field `Step` has is on the wire, in the service's OpenAPI schema and in `Step.to_dict`, and
nothing is on the wire that `Step` does not hold (but `failed`, `namespace` and `sequence`)."""

from __future__ import annotations

import dataclasses

import pytest

from rewardstack.errors import InputError
from rewardstack._service.protocol import SCORE_SCHEMA, ScoreBody
from rewardstack._wire import Refuse, Step, StepWire

STEP_FIELDS = [f.name for f in dataclasses.fields(Step)]
WIRE_ONLY = {"failed"}  # folded into `completions` (a failed response is None)
ENVELOPE = {"namespace", "sequence"}  # where the service applies the step, not the step


def test_step_and_the_wire_schema_have_the_same_fields() -> None:
    assert set(StepWire.model_fields) - WIRE_ONLY == set(STEP_FIELDS)
    required = {n for n, f in StepWire.model_fields.items() if f.is_required()}
    assert required == {f.name for f in dataclasses.fields(Step)
                        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def test_the_openapi_schema_is_every_field_a_step_accepts() -> None:
    assert set(SCORE_SCHEMA["properties"]) == set(STEP_FIELDS) | WIRE_ONLY | ENVELOPE
    assert set(SCORE_SCHEMA["required"]) == {"name", "prompt", "completions"}
    assert SCORE_SCHEMA == ScoreBody.model_json_schema()  # produced, not written by hand


def test_every_wire_field_says_why_it_refuses() -> None:
    for name, f in ScoreBody.model_fields.items():
        if name in ENVELOPE:
            continue  # the service's fields: namespace_for and the sequence's own refusal
        assert any(isinstance(m, Refuse) for m in f.metadata), name


def test_to_dict_writes_every_field_and_reads_back() -> None:
    step = Step(name="answer1", prompt="p", completions=["a", None], base_prompt="b", uids=[3, 4],
                completion_times=[0.5, 1.0], block=7, gating_loss=0.25, set_weights=[[1, 0.5]],
                new_forward_pass=False, logged_best="a")
    d = step.to_dict()
    assert list(d) == STEP_FIELDS
    assert Step.from_dict(d) == step
    bare = Step(name="augment", prompt="p", completions=[])
    assert bare.to_dict() == {"name": "augment", "prompt": "p", "completions": []}


@pytest.mark.parametrize("field", STEP_FIELDS)
def test_a_wrong_type_in_any_field_is_refused_naming_it(field: str) -> None:
    d = {"name": "augment", "prompt": "p", "completions": ["a"], field: {"not": "this"}}
    with pytest.raises(InputError) as e:
        Step.from_dict(d, line=2)
    assert e.value.field == field and str(e.value).startswith(f"line 2, field '{field}': ")
