"""`summary.json` of a run directory: each command adds its report under its own key.

Replay writes `replay`, the soak `soak`, the service soak `service_soak`; a key written before is
kept. One implementation for all of them: read what is there (an unreadable file starts afresh),
set the key, write atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` as JSON atomically (no NaN: the caller made it JSON-safe)."""
    from rewardstack.state import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(doc, ensure_ascii=False, indent=1, allow_nan=False).encode("utf-8"))


def merge_summary(run_dir: Path, key: str, report: Any) -> Path:
    """Set `summary.json[key] = report` in `run_dir`, keeping the other keys; returns the path."""
    path = Path(run_dir) / SUMMARY
    doc: dict[str, Any] = {}
    if path.exists():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            doc = {}
    doc[key] = report
    write_json(path, doc)
    return path
