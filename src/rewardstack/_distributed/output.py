"""What `rewardstack rescore` writes: one parquet file per run, a manifest, and the config it used.

Each run's table has one row per completion (step index, step name, uid where known, completion
index, every model's raw and normalized value, reward, status). A table is written to a temporary
name in the output folder and renamed when complete, so a file under its final name is always a
whole run. The file's schema metadata records the run's input fingerprint and the config
fingerprint, so completeness is read from the file itself; `manifest.jsonl` gets one line per run
as it finishes (complete or failed) and is a convenience index, rebuilt from the files if it lags.
Nothing here imports Ray.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from rewardstack.config import ALL_MODELS, StackConfig
from rewardstack.errors import ConfigError
from rewardstack._fileio import atomic_write, atomic_write_bytes
from rewardstack._telemetry.rundir import read_jsonl

MANIFEST = "manifest.jsonl"
CONFIG_FILE = "config.json"
META_KEY = b"rewardstack.rescore"
TMP_PREFIX = ".rescore-"

SCHEMA = pa.schema(
    [
        pa.field("step_index", pa.int64(), nullable=False),
        pa.field("step_name", pa.string(), nullable=False),
        pa.field("uid", pa.int64()),
        pa.field("completion_index", pa.int32(), nullable=False),
    ]
    + [f for name in ALL_MODELS for f in (pa.field(name, pa.float64()), pa.field(name + "_normalized", pa.float64()))]
    + [pa.field("reward", pa.float64()), pa.field("status", pa.string(), nullable=False)]
)
"""Columns of a run's table. Raw values a model could not give (NaN) are null; `status` says why."""


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def rows_from_event(step_index: int, event: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one scored step, from the event `RewardStack.score_step` built."""
    uids = event.get("uids")
    columns = [c for name in ALL_MODELS for c in (name, name + "_normalized")]
    return [{"step_index": step_index, "step_name": event["name"], "uid": uids[i] if uids is not None else None,
             "completion_index": i, **{c: _num(event[c][i]) for c in columns}, "reward": _num(event["rewards"][i]),
             "status": event["statuses"][i]} for i in range(len(event["rewards"]))]


def config_fingerprint(config: StackConfig) -> str:
    """A hash of what decides the scores: device and every model's settings (not the state dir)."""
    doc = {"device": config.device, "models": {n: m.model_dump() for n, m in sorted(config.models.items())}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_output(out_dir: Path, fingerprint: str) -> None:
    """Create the output folder for `fingerprint`, or refuse one written with another config.

    Mixing two configs' scores in one archive output would make the tables disagree silently.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CONFIG_FILE
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8")).get("config_fingerprint")
        if stored != fingerprint:
            raise ConfigError(
                "--output", f"{out_dir} holds scores of another config (fingerprint {stored}, this one is "
                f"{fingerprint}); choose a new output folder")
        return
    atomic_write_bytes(path, json.dumps({"config_fingerprint": fingerprint}, indent=1).encode())


def output_path(out_dir: Path, run_id: str) -> Path:
    """Where the table of run `run_id` lives once complete."""
    return out_dir / f"{run_id}.parquet"


def write_table(out_dir: Path, run_id: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Write one run's rows under a temporary name, fsync, and rename to the final name."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
    final = output_path(out_dir, run_id)
    # readable by everyone the umask allows (atomic_write's default mode)
    atomic_write(final, lambda f: pq.write_table(table, f), prefix=f"{TMP_PREFIX}{run_id}.")
    return final


def read_meta(path: Path) -> dict[str, Any] | None:
    """The rescore metadata of a finished table, or None if the file is missing or not ours."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return None
    raw = meta.get(META_KEY)
    return json.loads(raw) if raw else None


def remove_stale_temps(out_dir: Path) -> int:
    """Delete temporary tables a killed worker left behind; returns how many."""
    temps = list(out_dir.glob(f"{TMP_PREFIX}*.tmp"))
    for tmp in temps:
        tmp.unlink(missing_ok=True)
    return len(temps)


def read_manifest(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The last manifest line of each run (a torn last line, from a kill, is ignored)."""
    path = out_dir / MANIFEST
    if not path.exists():
        return {}
    return {e["run"]: e for e in read_jsonl(path) if isinstance(e, dict) and "run" in e}


def append_manifest(out_dir: Path, entries: Iterable[dict[str, Any]]) -> None:
    """Append finished runs to the manifest, one JSON line each, flushed to disk."""
    lines = "".join(json.dumps(e, sort_keys=True, allow_nan=False) + "\n" for e in entries)
    if not lines:
        return
    with open(out_dir / MANIFEST, "a", encoding="utf-8") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
