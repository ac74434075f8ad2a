"""Replay recorded validator runs: readers, replay, the reference's need.

- `readers`: the validator's loguru `completions.log` (rotated, compressed), the published parquet
  files (both layouts), rewardstack's own step and event JSONL; detected from content; they
  turn the numbers each format stores into what a step holds (the exports' doubles and NaN).
- `replay`: `rewardstack replay`: what drove each model's peak, the reference's need (`reference`),
  fit, agreement, what a `--budget` changed; a completion the recorded run cut stays `cut`;
  `--init-state` warm-starts a stack's state from a validator's log.

Exactly-once scoring itself is `rewardstack._runner`; the soak that proves it under kills and
injected OOMs lives beside the tests (`tests/soak`, `python -m tests.soak`). Guide: docs/REPLAY.md.
"""
