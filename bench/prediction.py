"""Prediction error per model over a workload: the cost model's predicted peak of every call
against the peak the tensor-bytes tracker measured, and the planned batches that ran out of memory.

Run alone: `python -m bench.prediction` (the bench workload, 9 steps x 50 completions, one of
40,000 characters; a few minutes on 2 cores with the stand-ins' calibration cached beside their
config), `--quick` (2 steps x 6), `--budget MiB` (a simulated activation budget, so the planner
packs by the predictions). `python -m bench` prints the same table under its full-stack rows.

The error of a call is |measured - predicted| / predicted, the telemetry's `error_ratio` made
absolute (`rewardstack._telemetry.monitor`: a call record's `predicted_bytes` and `peak_bytes`):
the share of what the planner set aside that was not used (or, under 0, was overrun). Only calls
that completed on the device count (an OOM'd or host-placed call has no device peak to compare).
A planned-batch OOM is any call whose outcome is not `ok` (the guard split it, fell back to the
CPU, or gave up); there must be none. The stack runs with the telemetry monitor attached, the
same records an operator's `report` reads.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rewardstack.stack import Step

TARGET = 0.15


@dataclass
class PredictionRow:
    """One model's calls over the workload."""

    model: str
    calls: int
    mean_abs_error: float | None
    max_abs_error: float | None
    median_error: float | None
    """Signed: under 0 the model over-predicts (measured below predicted)."""
    ooms: int


def measure(root: Path, steps: list[Step], *, budget: int | None = None) -> list[PredictionRow]:
    """Score `steps` on the stand-in stack under `root` (monitor attached); one row per model run."""
    from bench.fullstack import build_stack
    from rewardstack._telemetry.monitor import Monitor
    from rewardstack._telemetry.rundir import RunDir, read_timeline

    stack = build_stack(root, extra={"memory_budget": budget} if budget else None)
    run_dir = RunDir(root / f"prediction-run-{time.monotonic_ns()}")
    monitor = Monitor.attach(stack, run_dir=run_dir)
    try:
        for step in steps:
            stack.score_step(step, save=False)
    finally:
        monitor.close()
    calls = [r for r in read_timeline(run_dir.path) if r.get("type") == "call"]
    out = []
    for model in dict.fromkeys(c["model"] for c in calls):
        mine = [c for c in calls if c["model"] == model]
        errs = [c["error_ratio"] for c in mine if c.get("error_ratio") is not None and not c.get("on_host")]
        out.append(PredictionRow(
            model=model, calls=len(mine),
            mean_abs_error=statistics.fmean(abs(e) for e in errs) if errs else None,
            max_abs_error=max(abs(e) for e in errs) if errs else None,
            median_error=statistics.median(errs) if errs else None,
            ooms=sum(c.get("outcome") != "ok" for c in mine),
        ))
    return out


def lines(rows: list[PredictionRow], budget: int | None) -> list[str]:
    """The printed table: per model run, calls, mean / max |error|, median signed error, OOMs."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    out = [f"cost-model prediction error per model ({'budget ' + f'{budget / 2**20:.0f} MiB' if budget else 'no budget'}; "
           "error = |measured - predicted| / predicted per completed call; OOMs = planned batches that ran out of memory):",
           f"{'model':<26}{'calls':>7}{'pred err':>10}{'max err':>10}{'median':>9}{'OOMs':>6}"]
    for r in rows:
        out.append(f"{r.model:<26}{r.calls:>7}{pct(r.mean_abs_error):>10}{pct(r.max_abs_error):>10}"
                   f"{('-' if r.median_error is None else f'{100 * r.median_error:+.1f}%'):>9}{r.ooms:>6}")
    worst = max((r.mean_abs_error or 0.0 for r in rows), default=0.0)
    ooms = sum(r.ooms for r in rows)
    ok = worst <= TARGET and ooms == 0
    out.append(f"TARGET every model's pred err <= {TARGET:.0%} with no planned-batch OOM: worst {100 * worst:.1f}%, "
               f"OOMs {ooms}: {'met' if ok else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    from tests.soak.synthetic import heavy_tailed_steps

    ap = argparse.ArgumentParser(prog="python -m bench.prediction", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 steps x 6 completions (one of 3,000 characters)")
    ap.add_argument("--budget", type=float, help="a simulated activation budget in MiB (default: none)")
    ap.add_argument("--root", help="folder for the stand-ins and their calibration cache (default: a temp folder)")
    args = ap.parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    steps = heavy_tailed_steps(2, 6, long_chars=3_000) if args.quick else heavy_tailed_steps()
    budget = int(args.budget * 2**20) if args.budget else None
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(Path(args.root) if args.root else Path(tmp), steps, budget=budget)
    for line in lines(rows, budget):
        print(line)
    print(f"({len(steps)} steps, {time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
