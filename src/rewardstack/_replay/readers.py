"""Readers for the run logs operators already have, detected from their content (spec: run-logs.md).

- the validator's loguru `completions.log` (serialized JSON lines; only `EVENTS` records are steps),
  a run being the file or the folder holding it with its rotated siblings, plain or `.gz`/`.zip`,
  read in time order;
- the published per-run parquet files (through pyarrow), layout v1.0 (one row per forward pass:
  a `followup` and an `answer` step) or v1.1+ (one row per step);
- rewardstack's own step JSONL (what `score` reads) and event JSONL (what it writes).

Every record becomes a `RunStep`: a `Step` with the base prompt the validator built (the log holds
none: `augment` -> its own prompt; `followupN` -> the logged `best` of the forward pass's `augment`;
`answerN` -> the logged `best` of the `followupN` before it), the logged `best` as `logged_best` (the
blacklist records what the validator chose, so masks see what they saw), and the validator's own
per-model values when the log has them (for agreement and warm starts).

Empty completions: a failed call was logged as an empty completion. An empty completion is a failed
response (`None`, not scored) when its logged raw values of the reward models are all NaN, or when
the log has no per-model values at all; when a logged value is finite it was a real empty answer
and is scored as `""`. rewardstack's own events say it in `statuses`, which win when present. A
model whose logged raw and normalized values are all exactly 0 for a step was off in that run
(the validator logs zeros for it) and does not count as logged.

Numbers are converted from what each format stores to what a step holds here, at the edge;
`Step.from_dict` stays as strict as `score` needs it (a float `block` there is a mistake to name).
The published parquet exports store every number as a double (`block` 1000000.0, uids 12.0) and a
missing number as NaN (W&B's export goes through pandas); the loguru log and rewardstack's events
are JSON, where Python's `json` writes a missing float as a bare `NaN`. So, per field: a whole
number (`block`, each uid) is an int or a float with an integral value; NaN or null is "not
recorded" (the field is left out), except inside the uid list, where a hole cannot be filled and
the record is skipped. A measure (`gating_loss`, `set_weights`) keeps its value, NaN being "not
recorded"; a completion time not recorded is 0.0 (what an event without times says). Anything else
cannot be converted: an `InputError` naming the field and the value, and the record is skipped.

A completion rewardstack's own event records as `cut` (read to `[input] max_chars` only) keeps the
recorded head exactly as it was read, and `RunStep.cut` says which models cut it, so replay calls it
`cut` again (`replay.recorded_cut`).

Readers are lenient: unknown fields are ignored, missing optional ones take defaults, and a bad
record (a value that cannot be converted included) is reported with its file and line (or row) and
skipped; the rest is still read. Python's `json` reads the bare `NaN`/`Infinity` the validator's
`json` wrote.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from rewardstack.config import ALL_MODELS, REWARD_MODELS
from rewardstack.errors import InputError, RewardStackError
from rewardstack._fileio import parse
from rewardstack.stack import Step

log = logging.getLogger("rewardstack.replay")

LOGURU = "loguru"
PARQUET_V10 = "parquet-v1.0"
PARQUET_V11 = "parquet-v1.1"
EVENTS = "events"
STEPS = "steps"

_PARQUET_MAGIC = b"PAR1"
_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = b"PK\x03\x04"


class LogFormatError(RewardStackError):
    """A file is none of the run logs `replay` reads, or cannot be opened."""


@dataclass
class RunStep:
    """One step of a recorded run, ready to score, with what the log says about it."""

    step: Step
    where: str
    """File and line (or row) the step came from."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """The validator's raw value per completion, per model that it ran (NaN where it logged none)."""
    logged_rewards: list[float] | None = None
    """The validator's combined rewards, when logged."""
    cut: dict[str, list[int]] = field(default_factory=dict)
    """Per model, the completions the recorded run read only up to its `max_chars` (status `cut`)."""


@dataclass
class Run:
    """The steps of one or more run logs, in order, and the records that could not be read."""

    steps: list[RunStep] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    files: list[tuple[Path, str]] = field(default_factory=list)
    """Each file read and its detected kind, in reading order."""

    def why_empty(self) -> str:
        """Why no step was read (for a run with none), in one line."""
        where = ", ".join(f"{p} ({k})" for p, k in self.files)
        if self.errors:
            return (f"read no step from {where}: all {len(self.errors)} record(s) were skipped; "
                    f"the first: {self.errors[0]}")
        kinds = {k for _, k in self.files}
        held = ("no EVENTS record (the validator logs each step at level EVENTS)" if kinds == {LOGURU}
                else "no record")
        return f"read no step from {where}: it holds {held}"


# -- opening and detecting ------------------------------------------------------------------------

def _raw_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it is gzip or zip (by content, not by name)."""
    data = path.read_bytes()
    if data[:2] == _GZIP_MAGIC:
        return gzip.decompress(data)
    if data[:4] == _ZIP_MAGIC:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if not n.endswith("/")]
            if not names:
                raise LogFormatError(f"{path}: an empty zip archive")
            return z.read(names[0])
    return data


def _first_json(data: bytes) -> Any:
    for line in data.split(b"\n"):
        if line.strip():
            try:
                return json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                return None
    return None


def detect(path: str | Path) -> str:
    """The kind of a run log file, from its content: loguru, parquet-v1.0/v1.1, events or steps."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head == _PARQUET_MAGIC:
        import pyarrow.parquet as pq

        names = set(pq.read_schema(path).names)
        if "name" in names and "completions" in names:
            return PARQUET_V11
        if "base_prompt" in names and "followup_completions" in names:
            return PARQUET_V10
        raise LogFormatError(f"{path}: a parquet file with neither run layout (columns: {sorted(names)[:12]})")
    try:
        first = _first_json(_raw_bytes(path))
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise LogFormatError(f"{path}: cannot read ({e})") from e
    if isinstance(first, dict):
        if isinstance(first.get("record"), dict) and "text" in first:
            return LOGURU
        if "completions" in first:
            if "rewards" in first or "statuses" in first or any(m in first for m in ALL_MODELS):
                return EVENTS
            return STEPS
    raise LogFormatError(
        f"{path}: not a run log replay reads (a loguru completions.log, a run's parquet file, or "
        "rewardstack's step or event JSONL)"
    )


def _loguru_start(path: Path) -> float:
    """Timestamp of the file's first record (rotated files are read in time order)."""
    try:
        return float(_first_json(_raw_bytes(path))["record"]["time"]["timestamp"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def expand(paths: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """The files of the given runs with their kinds: a folder is the loguru log and its rotated siblings."""
    out: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise LogFormatError(f"{p}: no such file or folder")
        if not p.is_dir():
            out.append((p, detect(p)))
            continue
        found: list[tuple[Path, str]] = []
        for child in sorted(c for c in p.iterdir() if c.is_file() and not c.name.startswith(".")):
            try:
                found.append((child, detect(child)))
            except LogFormatError:
                log.info("%s: not a run log, skipped", child)
        logs = [f for f in found if f[1] == LOGURU]
        if logs:
            # loguru names rotated files by date; their first record's time orders them exactly.
            out.extend(sorted(logs, key=lambda f: (_loguru_start(f[0]), f[0].name)))
        else:
            out.extend(found)
        if not found:
            raise LogFormatError(f"{p}: holds no run log")
    return out


# -- records -> steps -----------------------------------------------------------------------------

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


def _numbers(values: Any, field: str, line: int | None, uids: bool) -> list[Any] | None:
    """Uids (whole numbers, none missing) or completion times (floats, 0.0 where one is not
    recorded), from a list; None when the list is not recorded."""
    if _missing(values):
        return None
    if not isinstance(values, (list, tuple)):
        kind = "whole numbers" if uids else "numbers"
        raise InputError(f"must be a list of {kind}, got {_show(values)}", line=line, field=field)
    out: list[Any] = []
    for i, v in enumerate(values):
        if uids:
            n = whole(v, f"{field}[{i}]", line)
            if n is None:  # one uid missing: which miner answered is unknown, and a guess would mislead
                raise InputError("is not recorded (null or NaN)", line=line, field=f"{field}[{i}]")
            out.append(n)
        elif _missing(v):
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
        "uids": _numbers(record.get(uids), uids, line, True),
        "completion_times": _numbers(record.get(times_of), times_of, line, False),
        "gating_loss": record.get("gating_loss"),
        "set_weights": record.get("set_weights"),
    }
    return {k: v for k, v in out.items() if not _missing(v)}


def _floats(values: Any, n: int) -> list[float] | None:
    """A list of n numbers (null -> NaN), or None when the field is not such a list."""
    if not isinstance(values, (list, tuple)) or len(values) != n or not all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        return None
    return [math.nan if v is None else float(v) for v in values]


def _logged_models(ev: Mapping[str, Any], n: int) -> dict[str, list[float]]:
    raw: dict[str, list[float]] = {}
    for m in ALL_MODELS:
        r = _floats(ev.get(m), n)
        if r is None:
            continue
        z = _floats(ev.get(m + "_normalized"), n)
        if n and all(x == 0.0 for x in r) and (z is None or all(x == 0.0 for x in z)):
            continue  # the model was off in that run: the validator logs zeros for it
        raw[m] = r
    return raw


def _failed(i: int, text: str, statuses: Any, logged: Mapping[str, list[float]]) -> bool:
    """Whether completion i was a failed call (see the module docstring for the rules)."""
    if isinstance(statuses, list) and i < len(statuses) and isinstance(statuses[i], str):
        return statuses[i] == "failed"
    if text.strip():
        return False
    values = [logged[m][i] for m in REWARD_MODELS if m in logged] or [v[i] for v in logged.values()]
    if not values:
        return True  # no logged values: an empty completion means a failed call
    return not any(math.isfinite(v) for v in values)


class _BasePrompts:
    """Rebuilds each step's base prompt and forward-pass boundary from the logged bests."""

    _N = re.compile(r"(\d+)$")

    def __init__(self) -> None:
        self.augment_best: str | None = None
        self.followup_best: dict[str, str] = {}
        self.last_followup: str | None = None

    def __call__(self, name: str, prompt: str, best: str | None, where: str) -> tuple[str | None, bool | None]:
        """(base prompt, opens a forward pass) for a step; None base prompt: the step's prompt."""
        best = best.strip() if isinstance(best, str) else None
        if name == "augment":
            self.augment_best, self.followup_best, self.last_followup = best, {}, None
            return prompt, True
        m = self._N.search(name)
        key = m.group(1) if m else ""
        if name.startswith("followup"):
            if best is not None:
                self.followup_best[key] = best
                self.last_followup = best
            if self.augment_best is None:
                log.warning("%s: %s without an augment step before it; its base prompt is its prompt", where, name)
            return self.augment_best, None
        if name.startswith("answer"):
            base = self.followup_best.get(key, self.last_followup)
            if base is None:
                log.warning("%s: %s without a followup step before it; its base prompt is its prompt", where, name)
            return base, None
        return None, None


def _event_step(ev: Mapping[str, Any], where: str, line: int | None, bases: _BasePrompts) -> RunStep:
    """A validator event (loguru extra, v1.1 row, rewardstack event) as a RunStep."""
    if not isinstance(ev, Mapping):
        raise InputError("an event must be an object", line=line)
    comps = ev.get("completions")
    if not isinstance(comps, list):
        raise InputError("missing or not a list", line=line, field="completions")
    n = len(comps)
    if not all(isinstance(c, str) or c is None for c in comps):
        raise InputError("must be a list of strings", line=line, field="completions")
    logged = _logged_models(ev, n)
    statuses = ev.get("statuses")
    completions = [None if c is None or _failed(i, c, statuses, logged) else c for i, c in enumerate(comps)]
    name, prompt, best = ev.get("name"), ev.get("prompt"), ev.get("best")
    if not isinstance(name, str) or not isinstance(prompt, str):
        raise InputError("'name' and 'prompt' must be strings", line=line)
    numbers = step_numbers(ev, line=line)  # before the base prompts move on: a skipped record changes nothing
    base, opens = bases(name, prompt, best if isinstance(best, str) else None, where)
    if isinstance(ev.get("base_prompt"), str):
        base = ev["base_prompt"]  # the event says what was scored (rewardstack's events do): no rebuilding
    d = {"name": name, "prompt": prompt, "completions": completions, **numbers, "base_prompt": base,
         "new_forward_pass": opens, "logged_best": best if isinstance(best, str) else None}
    step = Step.from_dict({k: v for k, v in d.items() if v is not None}, line=line)
    cut = _recorded_cut(ev.get("model_statuses"), n)
    for i in sorted({i for ix in cut.values() for i in ix}):
        if step.completions[i] is not None:
            # The recorded head exactly as the models read it: `from_dict` strips, and a head may end in a space.
            step.completions[i] = comps[i]
    return RunStep(step, where, logged, _floats(ev.get("rewards"), n), cut)


def _recorded_cut(model_statuses: Any, n: int) -> dict[str, list[int]]:
    """Per model, the completions rewardstack's event records as `cut` (`model_statuses`)."""
    if not isinstance(model_statuses, Mapping):
        return {}
    return {str(model): [i for i, s in enumerate(sts) if s == "cut"] for model, sts in model_statuses.items()
            if isinstance(sts, list) and len(sts) == n and "cut" in sts}


def _lines(path: Path) -> Iterator[tuple[str, int | None, str]]:
    text = _raw_bytes(path).decode("utf-8", errors="surrogateescape")
    # "\n" only: a record may hold U+0085 or U+2028 raw, which str.splitlines would split on.
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield f"{path}:{number}", number, line


def _parquet_rows(path: Path) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
    import pyarrow.parquet as pq

    rows = (row for batch in pq.ParquetFile(path).iter_batches(batch_size=256) for row in batch.to_pylist())
    for row_no, row in enumerate(rows):
        yield f"{path}: row {row_no}", None, row


def _loguru_steps(obj: Any, where: str, line: int | None, bases: _BasePrompts) -> list[RunStep]:
    record = obj.get("record") if isinstance(obj, dict) else None
    level = (record or {}).get("level") or {}
    if not isinstance(record, dict) or level.get("name") != "EVENTS":
        return []  # lines of other levels are not steps
    return [_event_step(record.get("extra") or {}, where, line, bases)]


def _v10_steps(row: Any, where: str, line: int | None, bases: _BasePrompts) -> list[RunStep]:
    """Layout v1.0: each row is one forward pass, a `followup` step then an `answer` step (both, or neither)."""
    base = text(row.get("base_prompt"), "base_prompt")
    followup_prompt = text(row.get("followup_prompt"), "followup_prompt") or base
    best_followup = text(row.get("best_followup"), "best_followup")
    steps = []
    for name, prompt, step_base, best in (
        ("followup", followup_prompt, base, best_followup),
        ("answer", text(row.get("answer_prompt"), "answer_prompt"), best_followup,
         text(row.get("best_answer"), "best_answer")),
    ):
        comps = row.get(f"{name}_completions")
        if not isinstance(comps, list):
            raise InputError("missing", field=f"{name}_completions")
        # No per-model values in this layout: an empty completion is a failed call.
        d: dict[str, Any] = {
            "name": name, "prompt": prompt,
            "completions": [c if isinstance(c, str) and c.strip() else None for c in comps],
            "base_prompt": step_base, "logged_best": best, "new_forward_pass": name == "followup" or None,
            **step_numbers(row, uids=f"{name}_uids", times_of=f"{name}_times"),
        }
        for key in ("uids", "completion_times"):  # a list of another length than the completions: left out
            if len(d.get(key) or comps) != len(comps):
                del d[key]
        step = Step.from_dict({k: v for k, v in d.items() if v is not None}, line=None)
        steps.append(RunStep(step, f"{where} ({name})", logged_rewards=_floats(row.get(f"{name}_rewards"), len(comps))))
    return steps


_READERS = {  # kind: (its records, a record's steps)
    LOGURU: (_lines, _loguru_steps),
    EVENTS: (_lines, lambda obj, where, line, bases: [_event_step(obj, where, line, bases)]),
    STEPS: (_lines, lambda obj, where, line, bases: [RunStep(Step.from_dict(obj, line=line), where)]),
    PARQUET_V10: (_parquet_rows, _v10_steps),
    PARQUET_V11: (_parquet_rows, lambda row, where, line, bases: [_event_step(row, where, line, bases)]),
}


def read_run(paths: Sequence[str | Path]) -> Run:
    """Every step of the given run logs (files or folders), in order; bad records in `errors`."""
    run = Run(files=expand(paths))
    bases = _BasePrompts()  # a run's forward passes may continue across rotated files
    for path, kind in run.files:
        records, steps_of = _READERS[kind]
        try:
            for where, line, record in records(path):
                try:
                    if line is not None:  # bounded nesting: a hostile line is named, never a RecursionError
                        record = parse(record, line=line)
                    run.steps.extend(steps_of(record, where, line, bases))
                except InputError as e:  # a line's error names its line itself
                    run.errors.append(f"{path if line is not None else where}: {e}")
        except (OSError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as e:
            run.errors.append(f"{path}: cannot read ({e})")
    for e in run.errors:
        log.warning("%s", e)
    return run

