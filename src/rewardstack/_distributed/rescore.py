"""`rewardstack rescore`: re-score an archive of runs on a pool of Ray actors.

Each run is one unit of work, scored in order from fresh state by one worker actor that loaded the
stack once. Ray Data's `map_batches` is not used on purpose: it neither keeps one file on one actor
nor its rows in order, and its actor pool rebuilds a crashed actor and retries the block, silently
dropping the state built from earlier blocks. Plain Ray core gives what per-run state needs:

- workers are actors with `max_restarts=-1` (Ray replaces a dead one by re-running its constructor)
  and no task retries; the driver resubmits the dead worker's run, from scratch, up to
  `max_attempts` times, so a run is scored whole by one process or not at all;
- a worker writes its run's table under a temporary name and renames it when complete, so a table
  under its final name is always a whole run; a rerun skips the runs whose table is complete for
  the same input and config;
- workers report per-step progress to a small progress actor; the driver prints runs done,
  completions per second and an ETA.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import uuid
from collections import deque
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


# -- the actors ---------------------------------------------------------------------------------
class RescoreWorker:
    """A Ray actor holding one loaded stack; scores whole runs, each from fresh state, and writes them.

    The stack's stateless part (`RewardStack.forward`) runs the forward passes, and a new stateful
    part (`RewardState`: normalizers, blacklist, diversity history) is made for every run, so
    nothing of one run leaks into the next.
    """

    def __init__(self, config: StackConfig, threads: int) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from rewardstack.stack import RewardStack

        hf_logging.disable_progress_bar()  # one bar per model in every worker's log is noise
        torch.set_num_threads(threads)  # one actor per core share: no oversubscription
        self.identity = {"pid": os.getpid(), "host": os.uname().nodename}
        # load_state=False: a rescore never reads or writes the validator's state directory.
        self.stack = RewardStack(config, load_state=False)

    def ready(self) -> dict[str, Any]:
        """Who this worker is, once its stack is loaded."""
        return self.identity

    def score_run(self, run: Run, out_dir: str, meta: dict[str, Any], progress: Any, job: str, attempt: int,
                  interval_s: float = 1.0) -> dict[str, Any]:
        """Score `run`, write its table (temporary name, then rename) and return its manifest entry.

        Every readable step in order (read by replay's readers: every format `rewardstack replay`
        reads); a bad record is listed and skipped. A run that cannot be read is a failed entry with
        the reason (it would fail again); a kill of this process leaves at most a temporary file,
        which the driver removes.
        """
        from rewardstack._replay import readers

        last = -math.inf

        def report(steps: int, completions: int, force: bool = False) -> None:
            nonlocal last
            if force or time.monotonic() - last >= interval_s:
                last = time.monotonic()
                progress.report.remote(job, run.id, attempt, steps, completions, self.identity)

        entry: dict[str, Any] = {"run": run.id, "input": run.path, "attempts": attempt, "worker": self.identity}
        report(0, 0, force=True)  # started, on this worker
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
                report(index + 1, completions)
        except Exception as e:  # noqa: BLE001 - a bad run is recorded, the worker goes on
            log.exception("run %s failed", run.path)
            return entry | {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        report(len(read.steps), completions, force=True)
        summary = {"steps": len(read.steps), "completions": completions, "bad_records": len(read.errors)}
        table_meta = meta | summary | {"run": run.id, "input": run.path, "input_fingerprint": fingerprint}
        path = out.write_table(Path(out_dir), run.id, rows, table_meta)
        return entry | summary | {
            "status": "complete", "output": path.name, "seconds": round(time.time() - started, 3),
            "bad": list(read.errors)[:20], "input_fingerprint": fingerprint,
        }


# -- the pool -----------------------------------------------------------------------------------
class RescorePool:
    """Worker actors with one loaded stack each; reusable across `rescore` calls (a notebook, tests).

    Workers restart without limit (Ray re-runs the constructor in a fresh process); their tasks are
    never retried by Ray, because only the driver knows to restart the whole run.
    """

    def __init__(self, config: StackConfig, size: int, *, gpus_per_worker: float = 0.0,
                 cpus_per_worker: float = 1.0) -> None:
        ray = require_ray()
        self.config = worker_config(config, gpus_per_worker)
        self.fingerprint = out.config_fingerprint(self.config)
        cls = ray.remote(RescoreWorker)
        self.actors = [
            cls.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=-1, max_task_retries=0,
                        namespace=RAY_NAMESPACE).remote(self.config, max(1, int(cpus_per_worker)))
            for _ in range(size)
        ]
        self.dead: set[int] = set()
        """Workers whose constructor failed: Ray will not bring them back."""
        self.progress = ray.remote(RescoreProgress).options(num_cpus=0, namespace=RAY_NAMESPACE).remote()
        """Where workers report each step (a new board per rescore would start after the first runs)."""

    def alive(self) -> list[int]:
        """Indices of the workers that can take runs."""
        return [i for i in range(len(self.actors)) if i not in self.dead]

    def close(self) -> None:
        """Stop every worker (without restart)."""
        ray = require_ray()
        for a in [*self.actors, self.progress]:
            ray.kill(a, no_restart=True)
        self.actors = []


# -- the driver ---------------------------------------------------------------------------------
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
    """Runs restarted from scratch because their worker died."""
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The manifest entry of every run this call finished (complete or failed)."""

    @property
    def ok(self) -> bool:
        """Whether every run is complete (scored now or before)."""
        return not self.failed and self.skipped + self.complete == self.total


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


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


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
    pool: RescorePool | None = None,
    on_progress: ProgressHook | None = None,
    progress_interval_s: float = 1.0,
    stream: TextIO | None = sys.stderr,
) -> RescoreReport:
    """Score every run not already complete in `output`; Ray must be initialized (`cluster.connect`).

    `pool` reuses loaded workers (its config wins); otherwise a pool of `workers` actors (default:
    as many as the cluster's GPUs or CPUs hold, at most one per run) is made and stopped at the end.
    `on_progress` is called on the driver about every `progress_interval_s` with the progress
    snapshot (runs in flight, their worker and steps done).
    """
    ray = require_ray()
    started = time.monotonic()
    out_dir = Path(output).resolve()
    fingerprint = pool.fingerprint if pool is not None else out.config_fingerprint(worker_config(config, gpus_per_worker))
    out.claim_output(out_dir, fingerprint)
    check_shared_path(out_dir, "the output folder")
    lock = output_lock(out_dir)
    own_pool = pool is None
    try:
        if out.remove_stale_temps(out_dir):
            log.info("removed temporary tables of a killed earlier rescore")
        report = RescoreReport(total=len(runs))
        todo = _plan(runs, out_dir, fingerprint, report)
        if not todo:
            _say(stream, f"rescore: all {report.total} runs already complete in {out_dir}")
            return report
        if pool is None:
            # By default as many workers as the cluster holds: by GPUs when workers take GPUs, else by CPUs.
            res = ray.cluster_resources()
            size = workers or max(1, int(res.get("GPU", 0) / gpus_per_worker) if gpus_per_worker > 0
                                  else int(res.get("CPU", 1) / max(cpus_per_worker, 1e-9)))
            pool = RescorePool(config, min(size, len(todo)), gpus_per_worker=gpus_per_worker,
                               cpus_per_worker=cpus_per_worker)
        job = _Job(ray, pool, report, todo, out_dir, fingerprint, max_attempts, progress_interval_s, started)
        _say(stream, f"rescore: {job.n_todo} runs to score on {len(pool.alive())} workers "
                     f"({report.skipped} already complete)")
        job.drive(on_progress, stream)
        pool.progress.forget.remote(job.id)
        report.seconds = time.monotonic() - started
        _say(stream, f"rescore: {report.complete} runs scored, {report.skipped} already complete, "
                     f"{len(report.failed)} failed, {report.restarts} restarted; {report.completions} completions "
                     f"in {report.seconds:.1f}s ({report.completions / max(report.seconds, 1e-9):.1f}/s)")
        return report
    finally:
        if own_pool and pool is not None:
            pool.close()
        out.remove_stale_temps(out_dir)  # a worker killed mid-write leaves one
        lock.release()


def _plan(runs: Sequence[Run], out_dir: Path, fingerprint: str, report: RescoreReport) -> deque[tuple[Run, int]]:
    """The runs to score (each at attempt 1), biggest first; the runs already complete count as skipped."""
    manifest = out.read_manifest(out_dir)
    todo: list[tuple[Run, int]] = []
    recovered = []
    for run in runs:
        entry = _complete_entry(run, out_dir, fingerprint)
        if entry is None:
            todo.append((run, 1))
            continue
        report.skipped += 1
        if manifest.get(run.id, {}).get("status") != "complete":
            recovered.append(entry)  # the table was renamed but its manifest line never written (driver killed)
    out.append_manifest(out_dir, recovered)
    # Biggest runs first: the job then ends on small runs, not on one long run while the rest idle.
    return deque(sorted(todo, key=lambda item: -item[0].size()))


class _Job:
    """A rescore under way: its runs to do and in flight, its workers, the progress board's latest answer."""

    def __init__(self, ray: Any, pool: RescorePool, report: RescoreReport, todo: deque[tuple[Run, int]], out_dir: Path,
                 fingerprint: str, max_attempts: int, interval_s: float, started: float) -> None:
        self.ray, self.pool, self.report = ray, pool, report
        self.todo, self.out_dir, self.fingerprint = todo, out_dir, fingerprint
        self.max_attempts, self.interval_s, self.started = max_attempts, interval_s, started
        self.n_todo = len(todo)
        self.idle = deque(pool.alive())
        self.id = uuid.uuid4().hex
        self.in_flight: dict[Any, tuple[int, Run, int]] = {}
        self.probes: dict[Any, int] = {}
        """`ready()` calls to workers Ray is restarting: a worker takes runs again once it answers."""
        self.snapshot_ref = pool.progress.snapshot.remote(self.id)
        self.snap: dict[str, Any] = {}
        self.last_print = 0.0
        self.last_done = -1

    def drive(self, on_progress: ProgressHook | None, stream: TextIO | None) -> None:
        """Hand the runs to idle workers and collect them, until none is left to do or in flight."""
        meta = {"config_fingerprint": self.fingerprint}
        while self.todo or self.in_flight:
            while self.todo and self.idle:
                worker = self.idle.popleft()
                run, attempt = self.todo.popleft()
                ref = self.pool.actors[worker].score_run.remote(run, str(self.out_dir), meta, self.pool.progress, self.id,
                                                                attempt, self.interval_s)
                self.in_flight[ref] = (worker, run, attempt)
            if not self.in_flight and not self.probes:
                break  # no worker left alive: the runs still to do are failed below
            ready, _ = self.ray.wait([*self.in_flight, *self.probes], num_returns=1, timeout=min(self.interval_s, 1.0))
            for ref in ready:
                if ref in self.probes:
                    self._probe(ref, self.probes.pop(ref))
                else:
                    self._collect(ref, *self.in_flight.pop(ref))
            if not self.pool.alive() and self.todo:
                for run, attempt in self.todo:
                    self._finish(run, {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt - 1,
                                       "error": "no worker could start (see the worker errors above)"})
                self.todo.clear()
            self._show_progress(on_progress, stream)

    def _finish(self, run: Run, entry: dict[str, Any]) -> None:
        self.report.entries[run.id] = entry
        out.append_manifest(self.out_dir, [entry])
        if entry["status"] == "complete":
            self.report.complete += 1
            self.report.completions += int(entry.get("completions") or 0)
        else:
            self.report.failed.append(entry)

    def _init_failed(self, e: Exception, worker: int) -> bool:
        """Whether `worker`'s constructor raised (bad model path on that node, ...): Ray will not restart it."""
        if not getattr(e, "actor_init_failed", False):
            return False
        log.error("worker %d could not start: %s", worker, e)
        self.pool.dead.add(worker)
        return True

    def _probe(self, ref: Any, worker: int) -> None:
        """A restarted worker's `ready()` answered: it takes runs again, is dead, or is asked again shortly."""
        from ray.exceptions import RayActorError

        try:
            self.ray.get(ref)
            self.idle.append(worker)
        except RayActorError as e:
            if not self._init_failed(e, worker):
                time.sleep(0.1)  # not up yet: ask again shortly
                self.probes[self.pool.actors[worker].ready.remote()] = worker

    def _collect(self, ref: Any, worker: int, run: Run, attempt: int) -> None:
        """A finished task: its run is done or failed, or goes back in the queue when its worker died."""
        from ray.exceptions import RayActorError

        try:
            entry = self.ray.get(ref)
        except RayActorError as e:
            if self._init_failed(e, worker):
                self.todo.appendleft((run, attempt))  # not this run's fault
                return
            # Ray is bringing it back (a new process, the stack loaded again): wait for it, rather
            # than hand it a run it would refuse while restarting.
            self.probes[self.pool.actors[worker].ready.remote()] = worker
            complete = _complete_entry(run, self.out_dir, self.fingerprint)
            if complete is not None:  # it died after the rename: the table is whole
                self._finish(run, complete | {"attempts": attempt})
            elif attempt < self.max_attempts:
                log.warning("worker %d died during run %s (attempt %d); Ray replaces it and the run restarts "
                            "from scratch", worker, run.path, attempt)
                self.report.restarts += 1
                self.todo.appendleft((run, attempt + 1))
            else:
                self._finish(run, {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt,
                                   "error": f"its worker died {attempt} times: {str(e).splitlines()[0]}"})
            return
        except Exception as e:  # noqa: BLE001 - a task error fails this run, not the job
            entry = {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt,
                     "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        self.idle.append(worker)
        self._finish(run, entry)

    def _show_progress(self, on_progress: ProgressHook | None, stream: TextIO | None) -> None:
        """Give `on_progress` the board's latest snapshot and, when due, print runs done, completions/s and the ETA."""
        now = time.monotonic()
        # A line every 2 s while runs finish, every 15 s while workers load or score long runs.
        done_runs = self.report.complete + len(self.report.failed)
        due = stream is not None and now - self.last_print >= (2.0 if done_runs != self.last_done else 15.0)
        if on_progress is None and not due:
            return
        # Never wait on the board: use the latest snapshot it has answered.
        if self.ray.wait([self.snapshot_ref], timeout=0)[0]:
            self.snap = self.ray.get(self.snapshot_ref)
            self.snapshot_ref = self.pool.progress.snapshot.remote(self.id)
        current = {run.id: (attempt, worker) for worker, run, attempt in self.in_flight.values()}
        partial = sum(s["completions"] for rid, s in self.snap.items()
                      if rid in current and s["attempt"] == current[rid][0])
        elapsed = now - self.started
        rate = (self.report.completions + partial) / elapsed if elapsed > 0 else 0.0
        # Per run, the mean of the runs this call completed (the report counts only those).
        per_run = self.report.completions / self.report.complete if self.report.complete else math.nan
        left = (self.n_todo - done_runs) * per_run - partial
        eta = left / rate if rate > 0 else math.nan
        if on_progress is not None:
            on_progress({"runs_done": done_runs, "runs_todo": self.n_todo, "completions_per_s": rate,
                         "eta_s": eta, "in_flight": {rid: self.snap.get(rid) for rid in current},
                         "workers": {rid: w for rid, (_, w) in current.items()}})
        if due:
            self.last_print, self.last_done = now, done_runs
            _say(stream, f"rescore: {done_runs}/{self.n_todo} runs done ({len(self.report.failed)} failed), "
                         f"{rate:.1f} completions/s, ETA {_eta(eta)}")


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
