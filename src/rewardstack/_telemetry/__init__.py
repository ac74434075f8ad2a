"""Telemetry: where the memory goes, per model call, per step and per OOM, afterwards and live.

- `monitor`: `Monitor` (a subscriber of the memory manager and of the stack's steps: call, step
  and placement records, OOM incidents and the CUDA allocation history, alarms, metrics,
  summary); `session`: `open_telemetry` and `Telemetry` for commands (the monitor with its run
  directory and endpoint).
- measured in the memory layer (`rewardstack._memory.device`): `MemorySnapshot` (allocator or
  simulated-device figures, RSS; subtractable) and `PeakWindow` (the nestable peak of one stretch
  of work).
- `rundir`: the run directory (timeline, events, incidents, summary) and its size cap.
- `metrics`: the Prometheus registry (`metrics.registry`, `render`, `metrics.serve`).
- `alarms`: leak and fragmentation alarms over memory at rest.
- `report`: `rewardstack report RUN_DIR`, plots (the card's account per step among them) and one
  self-contained HTML page.

The package itself exports `open_telemetry`, what the commands open. Record fields and units:
docs/TELEMETRY.md.
"""

from rewardstack._telemetry.session import open_telemetry

__all__ = ["open_telemetry"]
