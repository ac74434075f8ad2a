"""What the run-log formats store, converted to what a `Step` holds: done here, at the readers' edge.

`Step.from_dict` stays strict: it is what `rewardstack score` reads, and a float `block` there is a
mistake to name. The recorded formats store numbers their own way, and the readers convert them
before building a step (spec: run-logs.md):

- the published parquet exports store every number as a double (`block` 1000000.0, uids 12.0) and
  a missing number as NaN (W&B's export goes through pandas);
- the loguru log and rewardstack's events are JSON: integers stay integers, but Python's `json`
  writes a missing float as a bare `NaN`.

So, per field: a whole number (`block`, each uid) is an int or a float with an integral value;
NaN or null is "not recorded" (the field is left out), except inside the uid list, where a hole
cannot be filled and the record is skipped. A measure (`gating_loss`, `set_weights`) keeps its
value, NaN being "not recorded"; a completion time not recorded is 0.0 (what an event without
times says). Anything else cannot be converted: an `InputError` naming the field and the value,
and the reader skips that record with it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from rewardstack.errors import InputError


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(value: Any, field: str, line: int | None = None) -> int | None:
    """An integer from an int or an integral float; None when not recorded (null or NaN)."""
    if _missing(value):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise InputError(f"must be a whole number, got {_show(value)}", line=line, field=field)


def wholes(values: Any, field: str, line: int | None = None) -> list[int] | None:
    """A list of integers (uids) from ints or integral floats; None when the list is not recorded."""
    if _missing(values):
        return None
    if not isinstance(values, (list, tuple)):
        raise InputError(f"must be a list of whole numbers, got {_show(values)}", line=line, field=field)
    out = []
    for i, v in enumerate(values):
        n = whole(v, f"{field}[{i}]", line)
        if n is None:  # one uid missing: which miner answered is unknown, and a guess would mislead
            raise InputError("is not recorded (null or NaN)", line=line, field=f"{field}[{i}]")
        out.append(n)
    return out


def measure(value: Any) -> Any:
    """A recorded number or structure as it is; None for NaN or null (not recorded)."""
    return None if _missing(value) else value


def times(values: Any, field: str, line: int | None = None) -> list[float] | None:
    """Completion times as floats, 0.0 where one is not recorded; None when the list is not recorded."""
    if _missing(values):
        return None
    if not isinstance(values, (list, tuple)):
        raise InputError(f"must be a list of numbers, got {_show(values)}", line=line, field=field)
    out = []
    for i, v in enumerate(values):
        if _missing(v):
            out.append(0.0)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        else:
            raise InputError(f"must be a number, got {_show(v)}", line=line, field=f"{field}[{i}]")
    return out


def text(value: Any, field: str) -> str | None:
    """A string; None when not recorded (null, or NaN: pandas stores a column of missing texts as doubles)."""
    if _missing(value):
        return None
    if isinstance(value, str):
        return value
    raise InputError(f"must be a string, got {_show(value)}", field=field)


def step_numbers(record: Mapping[str, Any], *, uids: str = "uids", times_of: str = "completion_times",
                 line: int | None = None) -> dict[str, Any]:
    """The numeric fields of a step from a record, converted; those not recorded left out.

    `uids` and `times_of` name the record's columns (layout v1.0 has one pair per task); `line`
    is the record's line in its file, named in the error when a value cannot be converted.
    """
    out: dict[str, Any] = {
        "block": whole(record.get("block"), "block", line),
        "uids": wholes(record.get(uids), uids, line),
        "completion_times": times(record.get(times_of), times_of, line),
        "gating_loss": measure(record.get("gating_loss")),
        "set_weights": measure(record.get("set_weights")),
    }
    return {k: v for k, v in out.items() if v is not None}


__all__ = ["measure", "step_numbers", "text", "times", "whole", "wholes"]
