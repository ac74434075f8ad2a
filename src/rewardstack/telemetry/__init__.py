"""Telemetry: where the memory goes, per model call, per step and per OOM, afterwards and live.

- `snapshot`: `MemorySnapshot` (allocator or simulated-device figures, RSS; subtractable) and
  `PeakWindow` (the peak of one stretch of work).
- `monitor`: `Monitor` (the memory manager's observer and a stack `on_step` callback: call, step
  and placement records, incidents, alarms, metrics, summary) and `open_telemetry` for commands.
- `rundir`: the run directory (timeline, events, incidents, summary) and its size cap.
- `metrics`: the Prometheus registry (`registry`, `render`, `serve`).
- `incidents`: OOM incident records and the CUDA allocation history.
- `alarms`: leak and fragmentation alarms over memory at rest.
- `report`: `rewardstack report RUN_DIR`, plots and one self-contained HTML page.

Record fields and units: docs/TELEMETRY.md.
"""

from rewardstack.telemetry.alarms import Alarms, Trend
from rewardstack.telemetry.metrics import registry, render, serve
from rewardstack.telemetry.monitor import Monitor, Telemetry, notify_step, open_telemetry, step_record
from rewardstack.telemetry.rundir import RunDir, read_incidents, read_timeline
from rewardstack.telemetry.snapshot import MemorySnapshot, PeakWindow, take_snapshot

__all__ = [
    "Alarms",
    "MemorySnapshot",
    "Monitor",
    "PeakWindow",
    "RunDir",
    "Telemetry",
    "Trend",
    "notify_step",
    "open_telemetry",
    "read_incidents",
    "read_timeline",
    "registry",
    "render",
    "serve",
    "step_record",
    "take_snapshot",
]
