"""The run directory: what a scoring run leaves behind for people and for `rewardstack report`.

    D/timeline.jsonl        memory records (model calls, steps, placement moves, alarms), one per line
    D/timeline.NNNNNN.jsonl older timeline segments, oldest first (rotated)
    D/events.jsonl          the scored steps' events: the record of scores, never dropped
    D/incidents/            one JSON file per OOM (and, on CUDA, the allocator snapshot beside it)
    D/summary.json          the run at a glance, rewritten atomically as the run goes

The timeline and the incidents are capped so that weeks of running cannot fill the disk: the
timeline rotates into segments and, with the incidents, stays within `max_bytes` in all. The
timeline keeps at most half of it (its oldest segments go first), the incidents the other half
and at most `keep_incidents` records and `keep_snapshots` allocator snapshots (the oldest go
first). The events are not under the cap: nothing ever deletes one. Record fields: docs/TELEMETRY.md.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

from rewardstack._fileio import atomic_write_json, jsonable

log = logging.getLogger("rewardstack.telemetry")

TIMELINE = "timeline.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
INCIDENTS = "incidents"
SNAPSHOT_SUFFIX = ".snapshot.pickle"
ON_CARD = ("resident", "swapped_in")
"""The weight states (a step record's `card`) that occupy the card."""
_SEGMENT = re.compile(r"timeline\.(\d{6})\.jsonl$")


def dumps(record: dict[str, Any]) -> str:
    """One record as a JSON line (strict JSON, UTF-8 kept readable)."""
    try:
        return json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError:  # a NaN somewhere: write it as null rather than lose the record
        return json.dumps(jsonable(record), ensure_ascii=False, allow_nan=False) + "\n"


class RunDir:
    """Writes a run directory; appends to one that exists (a resumed run)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 256 * 1024**2,
        keep_incidents: int = 50,
        keep_snapshots: int = 3,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.keep_incidents = keep_incidents
        self.keep_snapshots = keep_snapshots
        # Small segments lose little history when the oldest goes; many keep listing cheap.
        self.segment_bytes = min(max(4096, self.max_bytes // 16), max(1, self.max_bytes // 4))
        self.incident_dir = self.path / INCIDENTS
        self.incident_dir.mkdir(parents=True, exist_ok=True)
        self._segments = sorted(p for p in self.path.iterdir() if _SEGMENT.match(p.name))
        self._next_segment = int(_SEGMENT.match(self._segments[-1].name).group(1)) + 1 if self._segments else 1
        self._timeline = open(self.path / TIMELINE, "a", encoding="utf-8")
        self._timeline_bytes = self._timeline.tell()
        self._events = open(self.path / EVENTS, "a", encoding="utf-8")
        # Numbered after the newest kept record: the cap may have dropped the oldest, so a count
        # of the files would reuse a number still on disk.
        numbers = (p.name[:6] for p in self.incident_dir.iterdir())
        self._incident_seq = max((int(n) for n in numbers if n.isdigit()), default=0)
        self._enforce()

    # -- writing ----------------------------------------------------------------------------
    def timeline(self, record: dict[str, Any]) -> None:
        """Append one record to the timeline (rotating and capping as needed)."""
        line = dumps(record)
        self._timeline.write(line)
        self._timeline_bytes += len(line.encode("utf-8"))
        if self._timeline_bytes >= self.segment_bytes:
            self._rotate()

    def event(self, event: dict[str, Any]) -> None:
        """Append one step's event and flush it: the events are never dropped."""
        self._events.write(dumps(event))
        self._events.flush()

    def flush(self) -> None:
        """Push buffered timeline lines to the file (once per step)."""
        self._timeline.flush()

    def incident(self, record: dict[str, Any], *, snapshot: Any = None) -> Path:
        """Write one incident record (and, given the allocator's `snapshot`, its pickle beside it)."""
        self._incident_seq += 1
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(record.get("model", "model")))[:60]  # safe in a file name
        stem = f"{self._incident_seq:06d}-step{record.get('step', 'na')}-{model}"
        if snapshot is not None:  # pragma: no cover - CUDA-only path (the allocator snapshot)
            snap = self.incident_dir / (stem + SNAPSHOT_SUFFIX)
            try:
                with open(snap, "wb") as f:
                    pickle.dump(snapshot, f)  # for torch.cuda._memory_viz; rewardstack never loads it
                record = {**record, "memory_snapshot": snap.name}
            except Exception as e:  # noqa: BLE001 - forensics must not stop scoring
                log.warning("could not write the allocator snapshot: %s", e)
        path = self.incident_dir / (stem + ".json")
        atomic_write_json(path, record)
        self._enforce()
        return path

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Replace summary.json atomically."""
        atomic_write_json(self.path / SUMMARY, summary)

    def close(self) -> None:
        """Flush and close the files (closing a closed file does nothing)."""
        self._timeline.close()
        self._events.close()

    # -- the cap ----------------------------------------------------------------------------
    def _rotate(self) -> None:
        self._timeline.close()
        seg = self.path / f"timeline.{self._next_segment:06d}.jsonl"
        self._next_segment += 1
        (self.path / TIMELINE).replace(seg)
        self._segments.append(seg)
        self._timeline = open(self.path / TIMELINE, "a", encoding="utf-8")
        self._timeline_bytes = 0
        self._enforce()

    def _enforce(self) -> None:
        half = self.max_bytes // 2
        # The timeline: its current segment stays (and grows to `segment_bytes` before it rotates);
        # the oldest rotated ones go first, leaving it that room.
        seg_total = sum(_size(p) for p in self._segments)
        while self._segments and seg_total > half - self.segment_bytes:
            old = self._segments.pop(0)
            seg_total -= _size(old)
            old.unlink(missing_ok=True)
        # The incidents: the newest records and snapshots stay, within the count and half the cap.
        records = sorted(self.incident_dir.glob("*.json"))
        snapshots = sorted(self.incident_dir.glob("*" + SNAPSHOT_SUFFIX))
        old_records = max(0, len(records) - self.keep_incidents)
        old_snapshots = max(0, len(snapshots) - self.keep_snapshots)
        for p in records[:old_records] + snapshots[:old_snapshots]:
            p.unlink(missing_ok=True)
        # Snapshots are the big files: they go before any record does.
        kept = snapshots[old_snapshots:] + records[old_records:]
        total = sum(_size(p) for p in kept)
        for p in kept:
            if total <= half:
                break
            total -= _size(p)
            p.unlink(missing_ok=True)
            log.warning("run directory over its cap: removed %s", p.name)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


# -- reading ----------------------------------------------------------------------------------
def timeline_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The timeline's files, oldest first (segments, then the current file)."""
    root = Path(run_dir)
    files = sorted(p for p in root.iterdir() if _SEGMENT.match(p.name))
    if (root / TIMELINE).exists():
        files.append(root / TIMELINE)
    return files


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one JSONL file; a torn last line (a killed run) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s: skipped a line that is not JSON (a run killed mid-write?)", path)


def read_timeline(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every timeline record still on disk, oldest first."""
    for p in timeline_files(run_dir):
        yield from read_jsonl(p)


def read_incidents(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every incident record still on disk, oldest first (each with its file name as `file`)."""
    out = []
    d = Path(run_dir) / INCIDENTS
    if d.is_dir():
        for p in sorted(d.glob("*.json")):
            try:
                out.append({**json.loads(p.read_text(encoding="utf-8")), "file": p.name})
            except (OSError, json.JSONDecodeError):
                log.warning("could not read incident %s", p)
    return out
