"""Replay recorded validator runs and soak long runs with faults: readers, replay, soak, pathological inputs.

- `readers`: the validator's loguru `completions.log` (rotated, compressed), the published parquet
  files (both layouts), rewardstack's own step and event JSONL; detected from content. `convert`
  turns the numbers each format stores into what a step holds (the exports' doubles and NaN).
- `replay`: `rewardstack replay`: what drove each model's peak, the reference's need (`reference`),
  fit, agreement; a completion the recorded run cut stays `cut` (`recorded_cut`);
  `--init-state` warm-starts a stack's state from a validator's log.
- `soak`: `rewardstack soak`, wiring its parts: `workload` (generated steps), `supervisor` (the
  scoring process, injected OOMs, kills and restarts), `comparison` (faulted against clean, memory
  at rest), `verdict`; `service_soak` soaks `rewardstack serve` the same way.
- `summary`: each command's report under its key in a run directory's `summary.json`.
- `pathological`: the inputs that break naive scorers, mixed into generated steps.

Exactly-once scoring itself is `rewardstack._runner`. Guide: docs/REPLAY.md.
"""

from typing import TYPE_CHECKING

from rewardstack._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._replay.readers import Run, RunStep, detect, read_run

__all__ = ["Run", "RunStep", "detect", "read_run"]
# Loaded on first use: the command line imports `replay.commands` for its parsers only.
__getattr__, __dir__ = lazy_names(__name__, {n: "rewardstack._replay.readers" for n in __all__})
