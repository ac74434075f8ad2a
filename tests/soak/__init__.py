"""The soak: verification tooling that proves exactly-once scoring and no leak, beside the tests.

`python -m tests.soak ...` (from the checkout's root) runs it; `python -m tests.soak.tiny DIR` builds
its tiny stand-in stack. Nothing here ships in the package: the product keeps only the hook the
fault injector needs (`MemoryManager.injector`, `rewardstack._memory.guard.InjectedOOM`).

- `soak`: the command, wiring `workload` (generated steps: `synthetic` lengths, `pathological`
  inputs), `supervisor` (the scoring process, injected OOMs from `faults`, kills and restarts),
  `comparison` (faulted against clean, memory at rest) and `verdict`; `service_soak` soaks
  `rewardstack serve` the same way.
- `tiny`: the tiny stand-in stack (every family at width 16) the soak and many tests run on.
- `synthetic`, `pathological`: generated steps the tests and the benchmarks use too.

Guide: docs/REPLAY.md.
"""
