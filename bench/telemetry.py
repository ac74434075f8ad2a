"""Telemetry's cost: a stand-in step with the monitor attached (run directory, metrics) against without.

Builds the offline stand-in stack once, then scores the same heavy-tailed steps in alternating
rounds, telemetry off and on, and prints the median step time of each and the overhead as a share
of the step time (target: below 2%). Two figures that do not depend on a quiet machine are printed
beside it: the monitor's own time per step (building, writing and counting the step's records,
timed inside the run) and the per-call cost of the wrapper around each forward pass (timed on an
empty forward), each as a share of the step time.

    .venv/bin/python bench/telemetry.py [--steps 6] [--rounds 3] [--completions 16] [--standins DIR]
    .venv/bin/python bench/telemetry.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _steps(n_steps: int, n: int) -> list[dict]:
    from tests.soak.synthetic import text

    rng = random.Random(0)
    tasks = ["augment", "followup0", "answer0", "followup1", "answer1"]
    out = []
    for s in range(n_steps):
        base = text(rng, 120)
        comps = [text(rng, rng.choice([3, 20, 60, 150, 400])) for _ in range(n)]
        out.append({"name": tasks[s % len(tasks)], "prompt": base + " Ask about it.", "base_prompt": base, "completions": comps})
    return out


def _timed_monitor() -> type:
    """A `Monitor` that times its own end-of-step work (`step_done`)."""
    from rewardstack._telemetry.monitor import Monitor

    class Timed(Monitor):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.seconds: list[float] = []
            self.calls_per_step: list[int] = []

        def step_done(self, report: Any) -> None:
            t0 = time.perf_counter()
            super().step_done(report)
            self.seconds.append(time.perf_counter() - t0)
            self.calls_per_step.append(report.record["calls"])

    return Timed


def _wrap_cost(calls: int = 20000) -> float:
    """Seconds the monitor adds to one model call (wrapper, peak window, record), on an empty forward."""
    from rewardstack._memory import CostModel, TensorBytesTracker
    from rewardstack._telemetry.monitor import Monitor

    tracker = TensorBytesTracker(None)
    mon = Monitor(tracker=tracker)
    cost = CostModel()
    lengths = [64, 32, 16, 8]

    def forward(idx: list[int]) -> list[int]:
        return idx

    wrapped = mon.batch("bench", lengths, forward, cost, False)
    with tracker:
        t = time.perf_counter()
        for _ in range(calls):
            forward([0, 1])
        bare = time.perf_counter() - t
        t = time.perf_counter()
        for k in range(calls):
            wrapped([0, 1])
            if k % 1000 == 999:
                mon._records.clear()  # the step end would take them
        watched = time.perf_counter() - t
    return (watched - bare) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--completions", type=int, default=16)
    p.add_argument("--standins", help="stand-in folder (built if missing; default a temporary one)")
    p.add_argument("--quick", action="store_true", help="2 steps, 1 round, 4 completions: checks that it runs")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds, args.completions = 2, 1, 4

    from prometheus_client import CollectorRegistry
    from transformers.utils import logging as hf_logging

    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack
    from rewardstack._standins import make_standins
    from rewardstack._telemetry.rundir import RunDir
    from rewardstack._telemetry.metrics import metrics_for

    hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(prefix="rewardstack-bench-telemetry-"))
    root = Path(args.standins) if args.standins else tmp / "standins"
    cfg = load_config(make_standins(root))
    cfg.state_dir = str(tmp / "state")
    t = time.perf_counter()
    stack = RewardStack(cfg, load_state=False)
    print(f"stand-in stack built in {time.perf_counter() - t:.1f}s; {args.steps} steps x {args.completions} completions, "
          f"{args.rounds} rounds per mode", file=sys.stderr)
    steps = _steps(args.steps, args.completions)
    stack.score_step(steps[0], save=False)  # warm-up: first-call costs out of both modes

    times: dict[str, list[float]] = {"off": [], "on": []}
    monitor_seconds: list[float] = []
    calls_per_step: list[int] = []
    for r in range(args.rounds):
        for mode in ("off", "on"):
            mon = None
            if mode == "on":
                # Time the monitor's own end-of-step work (record, files, metrics, alarms).
                mon = _timed_monitor().attach(stack, run_dir=RunDir(tmp / f"run{r}"), metrics=metrics_for(CollectorRegistry()))
            for s in steps:
                t0 = time.perf_counter()
                stack.score_step(s, save=False)
                times[mode].append(time.perf_counter() - t0)
            if mon is not None:
                monitor_seconds.extend(mon.seconds)
                calls_per_step.extend(mon.calls_per_step)
                mon.close()

    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    per_call = _wrap_cost(2000 if args.quick else 20000)
    calls = statistics.mean(calls_per_step) if calls_per_step else 0.0
    mon_step = statistics.median(monitor_seconds) if monitor_seconds else 0.0
    print()
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| median step, telemetry off | {off * 1000:.1f} ms |")
    print(f"| median step, telemetry on | {on * 1000:.1f} ms |")
    print(f"| overhead, A/B (on - off) / off | {100 * (on - off) / off:+.2f}% |")
    print(f"| model calls per step | {calls:.1f} |")
    print(f"| monitor's end-of-step work | {mon_step * 1000:.2f} ms = {100 * mon_step / off:.2f}% of a step |")
    print(f"| wrapper per call | {per_call * 1e6:.1f} us = {100 * per_call * calls / off:.3f}% of a step |")
    print(f"| attributable overhead (end of step + wrappers) | {100 * (mon_step + per_call * calls) / off:.2f}% (target < 2%) |")
    print("\nThe A/B figure is noisy on a busy machine; the attributable figure times telemetry's own code.")


if __name__ == "__main__":
    main()
