"""Replay recorded validator runs and soak long runs with faults: readers, replay, soak, pathological inputs.

- `readers`: the validator's loguru `completions.log` (rotated, compressed), the published parquet
  files (both layouts), rewardstack's own step and event JSONL; detected from content; they
  turn the numbers each format stores into what a step holds (the exports' doubles and NaN).
- `replay`: `rewardstack replay`: what drove each model's peak, the reference's need (`reference`),
  fit, agreement, what a `--budget` changed; a completion the recorded run cut stays `cut`;
  `--init-state` warm-starts a stack's state from a validator's log.
- `soak`: `rewardstack soak`, wiring its parts: `workload` (generated steps), `supervisor` (the
  scoring process, injected OOMs, kills and restarts), `comparison` (faulted against clean, memory
  at rest), `verdict`; `service_soak` soaks `rewardstack serve` the same way.
- `pathological`: the inputs that break naive scorers, mixed into generated steps.

Exactly-once scoring itself is `rewardstack._runner`. Guide: docs/REPLAY.md.
"""
