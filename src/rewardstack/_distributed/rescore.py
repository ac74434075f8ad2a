"""`rewardstack rescore`: re-score an archive of runs on Ray Data, one run per row.

The runs to score are a dataset of one row (and one block) each; `map_batches` with `batch_size=1`
hands them to a fixed pool of actors (`ActorPoolStrategy`), each holding one loaded stack. One call
is one whole run, scored in order from fresh state, its table written atomically (temporary name,
then rename), so no run's steps are split across actors and a table under its final name is always
a whole run. Ray Data does the scheduling and the retries: an actor that dies is restarted (its
constructor re-run) and its call retried, which scores that run again from scratch, as a whole run
must be.

- **Resume**: the driver skips the runs whose table is complete for the same input and config; a
  call skips one too (a retry of a run whose table was renamed just before its actor died).
- **Attempts**: each call asks the progress board which attempt of its run it is; past
  `max_attempts` (its actor dying each time) the run is recorded as failed, not scored again.
- **Progress**: calls report each step to the board; a driver thread prints runs done, completions
  per second (steps in progress included) and an ETA, beside Ray Data's own progress.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from rewardstack.config import StackConfig
from rewardstack._distributed import output as out
from rewardstack._distributed.cluster import RAY_NAMESPACE, check_shared_path, require_ray
from rewardstack._distributed.progress import RescoreProgress
from rewardstack._distributed.runs import Run
from rewardstack._distributed.scoring import worker_config
from rewardstack.errors import ClusterError
from rewardstack._state import StateLock, StateLockedError

log = logging.getLogger("rewardstack.distributed")


class RescoreWorker:
    """A Ray Data actor holding one loaded stack; each call scores one whole run from fresh state.

    The stack's stateless part (`RewardStack.forward`) runs the forward passes, and a new stateful
    part (`RewardState`: normalizers, blacklist, diversity history) is made for every run, so
    nothing of one run leaks into the next.
    """

    def __init__(self, config: StackConfig, threads: int, out_dir: str, fingerprint: str, progress: Any,
                 max_attempts: int, interval_s: float) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from rewardstack.stack import RewardStack

        hf_logging.disable_progress_bar()  # one bar per model in every worker's log is noise
        torch.set_num_threads(threads)  # one actor per core share: no oversubscription
        self.identity = {"pid": os.getpid(), "host": os.uname().nodename}
        # load_state=False: a rescore never reads or writes the validator's state directory.
        self.stack = RewardStack(config, load_state=False)
        self.out_dir, self.fingerprint, self.progress = Path(out_dir), fingerprint, progress
        self.max_attempts, self.interval_s = max_attempts, interval_s

    def __call__(self, batch: Any) -> Any:
        """One row (a run) in, one row (its manifest entry, as JSON) out."""
        import pyarrow as pa

        (row,) = batch.to_pylist()
        entry = self.score_run(Run(row["path"], row["id"], tuple(row["files"])))
        return pa.table({"entry": [json.dumps(entry, allow_nan=False)]})

    def score_run(self, run: Run) -> dict[str, Any]:
        """Score `run`, write its table and return its manifest entry.

        Every readable step in order (read by replay's readers: every format `rewardstack replay`
        reads); a bad record is listed and skipped. A run that cannot be read is a failed entry with
        the reason (it would fail again); a kill of this process leaves at most a temporary file,
        which the driver removes.
        """
        from rewardstack._replay import readers

        ray = require_ray()
        attempt = ray.get(self.progress.start.remote(run.id, self.identity))
        entry: dict[str, Any] = {"run": run.id, "input": run.path, "attempts": attempt, "worker": self.identity}
        complete = _complete_entry(run, self.out_dir, self.fingerprint)
        if complete is not None:  # its actor died after the rename: the table is whole
            return complete | {"attempts": attempt - 1}
        if attempt > self.max_attempts:
            return entry | {"status": "failed", "attempts": attempt - 1, "error": f"its worker died {attempt - 1} times"}
        last = time.monotonic()
        started = time.time()
        try:
            fingerprint = run.fingerprint()
            read = readers.read_run([run.path])
            state = self.stack.new_state()
            rows: list[dict[str, Any]] = []
            completions = 0
            for index, rs in enumerate(read.steps):
                rows += out.rows_from_event(index, state.apply(self.stack.forward(rs.step)).event)
                completions += len(rs.step.completions)
                if time.monotonic() - last >= self.interval_s:
                    last = time.monotonic()
                    self.progress.report.remote(run.id, attempt, index + 1, completions)
            summary = {"steps": len(read.steps), "completions": completions, "bad_records": len(read.errors)}
            table_meta = {"config_fingerprint": self.fingerprint, **summary, "run": run.id, "input": run.path,
                          "input_fingerprint": fingerprint}
            path = out.write_table(self.out_dir, run.id, rows, table_meta)
        except Exception as e:  # noqa: BLE001 - a bad run is recorded, the worker goes on
            log.exception("run %s failed", run.path)
            return entry | {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        return entry | summary | {
            "status": "complete", "output": path.name, "seconds": round(time.time() - started, 3),
            "bad": list(read.errors)[:20], "input_fingerprint": fingerprint,
        }


@dataclass
class RescoreReport:
    """What a rescore did."""

    total: int
    skipped: int = 0
    complete: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    completions: int = 0
    seconds: float = 0.0
    restarts: int = 0
    """Runs started again from scratch because their worker died."""
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The manifest entry of every run this call finished (complete or failed)."""

    @property
    def ok(self) -> bool:
        """Whether every run is complete (scored now or before)."""
        return not self.failed and self.skipped + self.complete == self.total

    def finish(self, out_dir: Path, entry: dict[str, Any]) -> None:
        """Count a finished run and append its manifest line."""
        self.entries[entry["run"]] = entry
        out.append_manifest(out_dir, [entry])
        self.restarts += max(0, int(entry.get("attempts") or 1) - 1)
        if entry["status"] == "complete":
            self.complete += 1
            self.completions += int(entry.get("completions") or 0)
        else:
            self.failed.append(entry)


ProgressHook = Callable[[dict[str, Any]], None]


def _complete_entry(run: Run, out_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    """The manifest entry of `run` when its table is whole for this input and config; else None."""
    path = out.output_path(out_dir, run.id)
    meta = out.read_meta(path)
    try:
        if (meta is None or meta.get("config_fingerprint") != fingerprint
                or meta.get("input_fingerprint") != run.fingerprint()):
            return None
    except OSError:  # an input gone since
        return None
    return {"run": run.id, "input": run.path, "status": "complete", "output": path.name,
            **{k: meta.get(k) for k in ("steps", "completions", "bad_records")}}


def output_lock(folder: Path) -> StateLock:
    """One rescore per output folder at a time (they would both write its manifest)."""
    try:
        return StateLock(folder, name=".rescore.lock").acquire()
    except StateLockedError:
        raise ClusterError(f"another rescore is writing {folder}; wait for it or choose another --output") from None


def rescore(
    runs: Sequence[Run],
    config: StackConfig,
    output: str | Path,
    *,
    workers: int | None = None,
    gpus_per_worker: float = 0.0,
    cpus_per_worker: float = 1.0,
    max_attempts: int = 3,
    on_progress: ProgressHook | None = None,
    progress_interval_s: float = 1.0,
    stream: TextIO | None = sys.stderr,
) -> RescoreReport:
    """Score every run not already complete in `output`; Ray must be initialized (`cluster.connect`).

    `workers` actors (default: as many as the cluster's GPUs or CPUs hold, at most one per run)
    load the stack and score the runs. `on_progress` is called about every `progress_interval_s`
    with the progress snapshot (runs done, rate, ETA, and each run in flight: its attempt, steps
    done and worker).
    """
    ray = require_ray()
    started = time.monotonic()
    config = worker_config(config, gpus_per_worker)
    fingerprint = out.config_fingerprint(config)
    out_dir = Path(output).resolve()
    out.claim_output(out_dir, fingerprint)
    check_shared_path(out_dir, "the output folder")
    lock = output_lock(out_dir)
    try:
        if out.remove_stale_temps(out_dir):
            log.info("removed temporary tables of a killed earlier rescore")
        report = RescoreReport(total=len(runs))
        todo = _plan(runs, out_dir, fingerprint, report)
        if not todo:
            _say(stream, f"rescore: all {report.total} runs already complete in {out_dir}")
            return report
        # By default as many workers as the cluster holds: by GPUs when workers take GPUs, else by CPUs.
        res = ray.cluster_resources()
        size = min(len(todo), workers or max(1, int(res.get("GPU", 0) / gpus_per_worker) if gpus_per_worker > 0
                                             else int(res.get("CPU", 1) / max(cpus_per_worker, 1e-9))))
        _say(stream, f"rescore: {len(todo)} runs to score on {size} workers ({report.skipped} already complete)")
        board = ray.remote(RescoreProgress).options(num_cpus=0, namespace=RAY_NAMESPACE).remote()
        ds = _dataset(ray, todo, size, gpus_per_worker, cpus_per_worker, config=config, out_dir=str(out_dir),
                      fingerprint=fingerprint, progress=board, max_attempts=max_attempts, interval_s=progress_interval_s)
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(ray, board, report, len(todo), started, stop,
                                                        progress_interval_s, on_progress, stream), daemon=True)
        watcher.start()
        try:
            for row in ds.iter_rows():
                report.finish(out_dir, json.loads(row["entry"]))
        except Exception as e:  # noqa: BLE001 - Ray Data gave up (no actor could start): the rest fail
            log.exception("rescore stopped")
            why = (str(e).strip().splitlines() or [""])[-1]  # a worker's error ends its traceback
            for run in todo:
                if run.id not in report.entries:
                    report.finish(out_dir, {"run": run.id, "input": run.path, "status": "failed", "attempts": 0,
                                            "error": f"the rescore stopped ({type(e).__name__}): {why}"})
        finally:
            stop.set()
            watcher.join()
            ray.kill(board)
        report.seconds = time.monotonic() - started
        _say(stream, f"rescore: {report.complete} runs scored, {report.skipped} already complete, "
                     f"{len(report.failed)} failed, {report.restarts} restarted; {report.completions} completions "
                     f"in {report.seconds:.1f}s ({report.completions / max(report.seconds, 1e-9):.1f}/s)")
        return report
    finally:
        out.remove_stale_temps(out_dir)  # a worker killed mid-write leaves one
        lock.release()


def _plan(runs: Sequence[Run], out_dir: Path, fingerprint: str, report: RescoreReport) -> list[Run]:
    """The runs to score, biggest first; the runs already complete count as skipped."""
    manifest = out.read_manifest(out_dir)
    todo: list[Run] = []
    recovered = []
    for run in runs:
        entry = _complete_entry(run, out_dir, fingerprint)
        if entry is None:
            todo.append(run)
            continue
        report.skipped += 1
        if manifest.get(run.id, {}).get("status") != "complete":
            recovered.append(entry)  # the table was renamed but its manifest line never written (driver killed)
    out.append_manifest(out_dir, recovered)
    # Biggest runs first: the job then ends on small runs, not on one long run while the rest idle.
    return sorted(todo, key=lambda run: -run.size())


def _dataset(ray: Any, todo: list[Run], size: int, gpus: float, cpus: float, **worker: Any) -> Any:
    """The runs as a dataset of one row and one block each (a retry is one run), mapped by `size`
    `RescoreWorker` actors, each made with `worker`'s arguments, into one manifest entry each."""
    ds = ray.data.from_items([{"path": r.path, "id": r.id, "files": list(r.files)} for r in todo],
                             override_num_blocks=len(todo))
    # One call in flight per actor: no run waits queued on a busy actor while another is idle.
    return ds.map_batches(RescoreWorker, batch_size=1, batch_format="pyarrow", num_cpus=cpus, num_gpus=gpus,
                          compute=ray.data.ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=1),
                          fn_constructor_kwargs={"threads": max(1, int(cpus)), **worker})


def _watch(ray: Any, board: Any, report: RescoreReport, n_todo: int, started: float, stop: threading.Event,
           interval_s: float, on_progress: ProgressHook | None, stream: TextIO | None) -> None:
    """Until `stop`: give `on_progress` the board's snapshot and, when due, print runs done,
    completions per second (steps in progress included) and the ETA."""
    last_print, last_done = 0.0, -1
    while not stop.wait(interval_s):
        in_flight = {rid: s for rid, s in ray.get(board.snapshot.remote()).items() if rid not in report.entries}
        partial = sum(s["completions"] for s in in_flight.values())
        now = time.monotonic()
        done = report.complete + len(report.failed)
        rate = (report.completions + partial) / max(now - started, 1e-9)
        # Per run, the mean of the runs this call completed (the report counts only those).
        per_run = report.completions / report.complete if report.complete else math.nan
        eta = ((n_todo - done) * per_run - partial) / rate if rate > 0 else math.nan
        if on_progress is not None:
            on_progress({"runs_done": done, "runs_todo": n_todo, "completions_per_s": rate, "eta_s": eta,
                         "in_flight": in_flight})
        # A line every 2 s while runs finish, every 15 s while workers load or score long runs.
        if stream is not None and now - last_print >= (2.0 if done != last_done else 15.0):
            last_print, last_done = now, done
            s = int(eta) if math.isfinite(eta) else -1
            left = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 0 else "?"
            _say(stream, f"rescore: {done}/{n_todo} runs done ({len(report.failed)} failed), "
                         f"{rate:.1f} completions/s, ETA {left}")


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
