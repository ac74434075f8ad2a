"""Benchmark of `rewardstack rescore`: completions per second on 1 and 2 Ray worker actors.

Run: `.venv/bin/python -m bench.rescore [--runs N] [--steps S] [--completions C] [--quick]`.
Builds the offline stand-in stack (or takes `--config`), writes N runs of S heavy-tailed steps of C
completions (no 40,000-character outlier, so each run costs about the same), starts a local Ray with
this machine's cores, and for 1 and 2 workers: rescores the runs into a fresh folder and prints
completions per second over the busiest worker's scoring time (each worker's runs' seconds added
up; loading the stacks and starting Ray Data's actors is the `load s` column, not in the rate) and
the scaling efficiency (rate with 2 workers / (2 x rate with 1)). Each worker runs torch on
`--cpus-per-worker` threads. On a busy shared machine the figures say little; measure on an idle one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from rewardstack.config import load_config
from rewardstack._standins import make_standins
from tests.soak.synthetic import heavy_tailed_steps


def write_runs(folder: Path, n_runs: int, n_steps: int, n_completions: int) -> list[Path]:
    """N step JSONL runs, one seed each (same shape, different texts)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(n_runs):
        steps = heavy_tailed_steps(n_steps, n_completions, seed=100 + r, long_chars=0)
        path = folder / f"run{r:04d}.jsonl"
        path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in steps), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="stack config (default: the offline stand-ins, built in a temp folder)")
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--completions", type=int, default=16)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--workers", default="1,2", help="pool sizes to time, comma-separated")
    p.add_argument("--quick", action="store_true", help="4 runs of 2 steps of 4 completions (checks it runs)")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.completions = 4, 2, 4
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import ray

    from rewardstack._distributed.rescore import rescore
    from rewardstack._distributed.runs import discover_runs

    sizes = [int(x) for x in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = load_config(args.config or make_standins(root / "standins"))
        config.state_dir = str(root / "state")
        runs = discover_runs(write_runs(root / "runs", args.runs, args.steps, args.completions))
        cpus = os.cpu_count() or 1
        ray.init(num_cpus=max(cpus, int(max(sizes) * args.cpus_per_worker)), include_dashboard=False,
                 log_to_driver=False)
        rows = []
        try:
            for k in sizes:
                t = time.perf_counter()
                report = rescore(runs, config, root / f"out-{k}", workers=k, cpus_per_worker=args.cpus_per_worker,
                                 stream=None)
                seconds = time.perf_counter() - t
                if not report.ok:
                    print(f"rescore with {k} workers failed: {report.failed}", file=sys.stderr)
                    return 1
                busy: dict[int, float] = {}
                for e in report.entries.values():
                    busy[e["worker"]["pid"]] = busy.get(e["worker"]["pid"], 0.0) + e["seconds"]
                scoring = max(busy.values())
                rows.append((k, report.completions, scoring, report.completions / scoring, seconds - scoring))
        finally:
            ray.shutdown()
    base = rows[0][3] / rows[0][0]
    print(f"rescore: {args.runs} runs x {args.steps} steps x {args.completions} completions, stand-in stack, "
          f"{os.cpu_count()} cores, {args.cpus_per_worker:g} CPU per worker")
    print(f"{'workers':>7} {'completions':>11} {'seconds':>8} {'compl/s':>8} {'efficiency':>10} {'load s':>7}")
    for k, n, s, rate, load in rows:
        print(f"{k:>7} {n:>11} {s:>8.2f} {rate:>8.1f} {rate / (k * base):>10.2f} {load:>7.1f}")
    print("seconds: the busiest worker's scoring; efficiency = rate / (workers x rate of 1 worker); load s (the "
          "stacks loaded, the actors started) is not in the rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
