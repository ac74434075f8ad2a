"""The soak's scoring process and its supervisor: injected OOMs, SIGKILLs at random moments, restarts.

`worker` (run as `python -m tests.soak.supervisor ARGS_JSON`, the checkout's root on its path) is the exactly-once loop of
`rewardstack._runner.score_file` with a `FaultInjector` that raises OOMs inside real forward passes;
it commits each step's OOM records with its event (`soak_ooms`) and logs memory at rest after every
step. `supervise` runs it to the end, SIGKILLing it at random moments (after a random number of
committed steps plus a random fraction of a step, so mid-pass too) and restarting it with the same
arguments; `spawn` alone starts one without kills (the clean run, side by side with the faulted one).
`Pace` picks the kill moments, here and for the service soak's server.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rewardstack import _paths as paths
from rewardstack.config import load_config
from rewardstack.stack import RewardStack, Step
from rewardstack._fileio import merge_json_section
from rewardstack._memory.device import process_rss
from rewardstack._runner import score_file
from rewardstack._settings import parse_bytes
from rewardstack._state import StateLock

from tests.soak.faults import FaultInjector

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: its processes import `tests.soak` from here, wherever the soak was started."""
MAX_CRASHES = 3
POLL_S = 0.02
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc settings for the soak's processes, whose resident set is judged. glibc raises its mmap
threshold each time a large block is freed, after which activations come from the heap and their
pages stay with the process: measured on the tiny stack, RSS then climbs 480 -> 860 MiB over 100
steps with nothing leaked; with the threshold fixed at 64 KiB (activations mmapped, returned on
free) it stays within 425..445 MiB. The setting changes where freed pages go, not what is kept."""


def new_run_dir(args: argparse.Namespace, kind: str) -> Path:
    """`--run-dir`, or a new folder `<kind>-<time>` under the config's runs; made."""
    run_dir = Path(args.run_dir) if args.run_dir else paths.new_run_dir(args.config, kind)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def finish(run_dir: Path, key: str, verdict: dict[str, Any], text: str) -> dict[str, Any]:
    """Write the verdict into summary.json under `key` (strict JSON: NaN as null) and print it."""
    merge_json_section(run_dir / "summary.json", key, verdict)
    print(text)
    return verdict


def popen(cmd: list[str], log: Path, threads: int = 1) -> subprocess.Popen:
    """One of the soak's processes (a scoring worker, the server), its output in `log`."""
    env = {**os.environ, **MALLOC_ENV, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("REWARDSTACK_TOKEN", None)  # loopback, no token: the service soak's clients send none
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


class Pace:
    """Kill moments: once `progress()` (committed steps, answers) reaches a target, a random moment
    inside the next unit of work, from the average time a unit took (so mid-pass too)."""

    def __init__(self, progress: Callable[[], int], seed: int) -> None:
        self.progress, self.rng, self.seconds = progress, random.Random(seed), 0.0
        self.restarted()

    def restarted(self) -> None:
        """A process (re)started: its first unit includes its start-up, so is not timed."""
        self.last_n, self.last_t = self.progress(), None

    def targets(self, kills: int, last: int) -> list[int]:
        """`kills` progress counts to kill at, drawn from 1..`last` - 1, in order."""
        room = range(1, max(2, last))
        return sorted(self.rng.sample(room, min(kills, len(room))))

    def wait(self, target: int, running: Callable[[], bool], scale: float = 1.0) -> float | None:
        """Poll until `target` units are done, then sleep a random moment: its length, or None when
        `running()` turned false first."""
        while running() and self.progress() < target:
            time.sleep(POLL_S)
            n = self.progress()
            if n > self.last_n:
                now = time.time()
                if self.last_t is not None:
                    dt = (now - self.last_t) / (n - self.last_n)
                    self.seconds = dt if self.seconds == 0 else 0.8 * self.seconds + 0.2 * dt
                self.last_n, self.last_t = n, now
        if not running():
            return None
        delay = self.rng.uniform(0.0, 0.9 * self.seconds * scale) if self.seconds else self.rng.uniform(0.0, 0.3)
        time.sleep(delay)
        return delay


def worker(args: argparse.Namespace) -> int:
    """One scoring process of the soak: exactly-once `score` with injected OOMs; memory at rest logged."""
    torch.set_num_threads(args.threads)  # the faulted and clean runs share the machine's cores
    cfg = load_config(args.config)
    cfg.state_dir = args.state_dir
    if args.budget:
        cfg.memory_budget = parse_bytes(args.budget, key="--budget")
    with StateLock(cfg.state_dir), open(args.rest, "a", encoding="utf-8") as rest:
        stack = RewardStack(cfg)
        if args.ready:  # built and calibrated: the cache now holds what the other run reads
            Path(args.ready).touch()
        # Everything alive now (modules, weights, tokenizers) lives as long as the process: freeze
        # it out of the cyclic collector, so the full `gc.collect()` the guard runs after every
        # OOM (one pass in ten here) walks only what the steps made, not the whole loaded stack.
        gc.freeze()
        if args.faults > 0:
            stack.memory.injector = FaultInjector(args.faults, seed=args.seed)
        seen = [stack.memory.ooms_total]  # a total: oom_log is a bounded ring buffer

        def on_result(step: Step, result: Any) -> None:
            fresh, seen[0] = stack.memory.ooms_total - seen[0], stack.memory.ooms_total
            new = list(stack.memory.oom_log)[-fresh:] if fresh else []
            # Committed with the event: OOM counts are exact per committed step, kills or not.
            result.event["soak_ooms"] = [{"model": r.model, "action": r.action, "injected": r.injected} for r in new]
            tracker, history = stack.memory.tracker, stack.state.diversity.history
            # Memory at rest: the simulated device's live bytes (CPU) or the allocator's (CUDA).
            at_rest = (tracker.live_bytes if tracker is not None else
                       torch.cuda.memory_allocated(stack.device) if stack.device.type == "cuda" else 0)
            rest.write(json.dumps({"pid": os.getpid(), "steps": stack.steps_scored, "rest_bytes": int(at_rest),
                                   "rss_bytes": process_rss()[0],
                                   "history_rows": int(history.shape[0]) if history is not None else 0}) + "\n")
            rest.flush()

        report = score_file(stack, args.input, args.output, on_result=on_result, progress=False,
                            err=open(os.devnull, "w"))
    print(f"worker {os.getpid()}: scored {report.scored}, resumed after {report.resumed}, redone {report.redone}",
          file=sys.stderr)
    return 0


class LineCounter:
    """Complete lines in a growing file, read incrementally (the supervisor polls it every few ms)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def __call__(self) -> int:
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # truncated (a torn line dropped on restart): count again
                    self.offset = self.lines = 0
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        end = chunk.rfind(b"\n") + 1  # a partial last line is counted when it is complete
        self.lines += chunk.count(b"\n", 0, end)
        self.offset += end
        return self.lines


def spawn(cfg: str, steps: Path, folder: Path, *, faults: float, seed: int, budget: str | None, tag: str,
          threads: int = 1, ready: Path | None = None) -> subprocess.Popen:
    """Start one scoring process on `folder` (events, state, memory log, its own log file); it
    touches `ready`, if given, once its stack is built and calibrated."""
    folder.mkdir(parents=True, exist_ok=True)
    args = {"config": cfg, "input": str(steps), "output": str(folder / "events.jsonl"),
            "state_dir": str(folder / "state"), "rest": str(folder / "rest.jsonl"), "faults": faults, "seed": seed,
            "threads": threads, "budget": budget, "ready": str(ready) if ready is not None else None}
    return popen([sys.executable, "-m", "tests.soak.supervisor", json.dumps(args)],
                 folder / f"worker-{tag}.log", threads)


def supervise(args: argparse.Namespace, steps_path: Path, folder: Path, n_steps: int) -> dict[str, Any]:
    """Run the scoring process to the end, killing it `args.kills` times at random moments."""
    pace = Pace(LineCounter(folder / "events.jsonl"), args.seed + 7)
    # Kill points leave at least one step after them, so a kill within one step's time lands.
    targets = pace.targets(args.kills, n_steps - 1) if n_steps > 1 else []
    kills = crashes = 0
    kill_points: list[dict[str, Any]] = []
    while True:  # every kill and every crash is followed by a restart
        proc = spawn(args.config, steps_path, folder, faults=args.faults, seed=args.seed + 1000 * (kills + crashes),
                     budget=args.budget, tag=str(kills + crashes), threads=args.threads)
        pace.restarted()
        # A process that ends before its moment comes uses up that kill (counted below).
        delay = pace.wait(targets.pop(0), lambda: proc.poll() is None) if targets else None
        if delay is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            kill_points.append({"after_committed": pace.progress(), "delay_s": round(delay, 3)})
            continue
        rc = proc.wait()
        if rc == 0:
            break
        crashes += 1
        if crashes > MAX_CRASHES:
            break
    return {"kills": kills, "restarts": kills + crashes, "crashes": crashes, "kill_points": kill_points}


if __name__ == "__main__":  # the scoring process `spawn` starts, its arguments as one JSON object
    import logging

    from transformers.utils import logging as hf_logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hf_logging.disable_progress_bar()
    sys.exit(worker(argparse.Namespace(**json.loads(sys.argv[1]))))
