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
from rewardstack.errors import ClusterError
from rewardstack._state import StateLock, StateLockedError

log = logging.getLogger("rewardstack.distributed")


# -- the actors ---------------------------------------------------------------------------------
class RescoreWorker:
    """A Ray actor holding one loaded stack; scores whole runs from fresh state and writes them."""

    def __init__(self, config: StackConfig, threads: int | None = None) -> None:
        import torch

        from transformers.utils import logging as hf_logging

        from rewardstack._distributed.scoring import RunScorer, worker_identity

        hf_logging.disable_progress_bar()  # one bar per model in every worker's log is noise
        if threads:
            torch.set_num_threads(threads)  # one actor per core share: no oversubscription
        self.identity = worker_identity()
        self.scorer = RunScorer(config)

    def ready(self) -> dict[str, Any]:
        """Who this worker is, once its stack is loaded."""
        return self.identity

    def score_run(self, run: Run, out_dir: str, meta: dict[str, Any], progress: Any, job: str, attempt: int,
                  interval_s: float = 1.0) -> dict[str, Any]:
        """Score `run`, write its table (temporary name, then rename) and return its manifest entry.

        A run that cannot be read is a failed entry with the reason (it would fail again); a kill
        of this process leaves at most a temporary file, which the driver removes.
        """
        last = [0.0]

        def report(steps: int, completions: int) -> None:
            now = time.monotonic()
            if progress is not None and now - last[0] >= interval_s:
                last[0] = now
                progress.report.remote(job, run.id, attempt, steps, completions, self.identity)

        entry: dict[str, Any] = {"run": run.id, "input": run.path, "attempts": attempt, "worker": self.identity}
        if progress is not None:
            progress.report.remote(job, run.id, attempt, 0, 0, self.identity)  # started, on this worker
        try:
            fingerprint = run.fingerprint()
            scores = self.scorer.score_run(run, report)
        except Exception as e:  # noqa: BLE001 - a bad run is recorded, the worker goes on
            log.exception("run %s failed", run.path)
            return entry | {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        if progress is not None:
            progress.report.remote(job, run.id, attempt, scores.steps, scores.completions, self.identity)
        summary = {"steps": scores.steps, "completions": scores.completions, "bad_records": len(scores.bad_records)}
        table_meta = meta | summary | {"run": run.id, "input": run.path, "input_fingerprint": fingerprint}
        path = out.write_table(Path(out_dir), run.id, scores.rows, table_meta)
        return entry | summary | {
            "status": "complete", "output": path.name, "seconds": round(scores.seconds, 3),
            "bad": scores.bad_records[:20], "input_fingerprint": fingerprint,
        }


# -- the pool -----------------------------------------------------------------------------------
def pool_size(gpus_per_worker: float, cpus_per_worker: float) -> int:
    """How many workers the cluster holds: by GPUs when workers take GPUs, else by CPUs."""
    ray = require_ray()
    res = ray.cluster_resources()
    if gpus_per_worker > 0:
        return max(1, int(res.get("GPU", 0) / gpus_per_worker))
    return max(1, int(res.get("CPU", 1) / max(cpus_per_worker, 1e-9)))


class RescorePool:
    """Worker actors with one loaded stack each; reusable across `rescore` calls (a notebook, tests).

    Workers restart without limit (Ray re-runs the constructor in a fresh process); their tasks are
    never retried by Ray, because only the driver knows to restart the whole run.
    """

    def __init__(self, config: StackConfig, size: int, *, gpus_per_worker: float = 0.0,
                 cpus_per_worker: float = 1.0) -> None:
        ray = require_ray()
        from rewardstack._distributed.scoring import worker_config

        self.config = worker_config(config, gpus_per_worker)
        self.fingerprint = out.config_fingerprint(self.config)
        threads = max(1, int(cpus_per_worker))
        cls = ray.remote(RescoreWorker)
        self.actors = [
            cls.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=-1, max_task_retries=0,
                        namespace=RAY_NAMESPACE).remote(self.config, threads)
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


def _is_complete(run: Run, path: Path, fingerprint: str) -> bool:
    meta = out.read_meta(path)
    if meta is None or meta.get("config_fingerprint") != fingerprint:
        return False
    try:
        return meta.get("input_fingerprint") == run.fingerprint()
    except OSError:
        return False


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
    if pool is not None:
        fingerprint = pool.fingerprint
    else:
        from rewardstack._distributed.scoring import worker_config

        fingerprint = out.config_fingerprint(worker_config(config, gpus_per_worker))
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
            size = workers or pool_size(gpus_per_worker, cpus_per_worker)
            pool = RescorePool(config, min(size, len(todo)), gpus_per_worker=gpus_per_worker,
                               cpus_per_worker=cpus_per_worker)
        job = _Job(pool, report, todo, len(todo), deque(pool.alive()), started)
        _say(stream, f"rescore: {job.n_todo} runs to score on {len(pool.alive())} workers "
                     f"({report.skipped} already complete)")
        _drive(ray, job, out_dir, fingerprint, max_attempts, progress_interval_s, on_progress, stream)
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
    todo: deque[tuple[Run, int]] = deque()
    recovered = []
    for run in runs:
        if _is_complete(run, out.output_path(out_dir, run.id), fingerprint):
            report.skipped += 1
            if manifest.get(run.id, {}).get("status") != "complete":
                # The table was renamed but its manifest line never written (driver killed).
                meta = out.read_meta(out.output_path(out_dir, run.id)) or {}
                recovered.append({"run": run.id, "input": run.path, "status": "complete",
                                  "output": out.output_path(out_dir, run.id).name,
                                  **{k: meta.get(k) for k in ("steps", "completions", "bad_records")}})
        else:
            todo.append((run, 1))
    out.append_manifest(out_dir, recovered)
    # Biggest runs first: the job then ends on small runs, not on one long run while the rest idle.
    return deque(sorted(todo, key=lambda item: -item[0].size()))


@dataclass
class _Job:
    """A rescore under way: its runs to do and in flight, its workers, the progress board's latest answer."""

    pool: RescorePool
    report: RescoreReport
    todo: deque[tuple[Run, int]]
    n_todo: int
    idle: deque[int]
    started: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    in_flight: dict[Any, tuple[int, Run, int]] = field(default_factory=dict)
    probes: dict[Any, int] = field(default_factory=dict)
    """`ready()` calls to workers Ray is restarting: a worker takes runs again once it answers."""
    snapshot_ref: Any = field(init=False)
    snap: dict[str, Any] = field(default_factory=dict)
    last_print: float = 0.0
    last_done: int = -1

    def __post_init__(self) -> None:
        self.snapshot_ref = self.pool.progress.snapshot.remote(self.id)


def _drive(ray: Any, job: _Job, out_dir: Path, fingerprint: str, max_attempts: int, interval_s: float,
           on_progress: ProgressHook | None, stream: TextIO | None) -> None:
    """Hand the runs to idle workers and collect them, until none is left to do or in flight."""
    meta = {"config_fingerprint": fingerprint}
    while job.todo or job.in_flight:
        while job.todo and job.idle:
            worker = job.idle.popleft()
            run, attempt = job.todo.popleft()
            ref = job.pool.actors[worker].score_run.remote(run, str(out_dir), meta, job.pool.progress, job.id, attempt,
                                                           interval_s)
            job.in_flight[ref] = (worker, run, attempt)
        if not job.in_flight and not job.probes:
            break  # no worker left alive: the runs still to do are failed below
        ready, _ = ray.wait([*job.in_flight, *job.probes], num_returns=1, timeout=min(interval_s, 1.0))
        for ref in ready:
            if ref in job.probes:
                worker = job.probes.pop(ref)
                state = _probe(ray, ref, job.pool, worker)
                if state == "alive":
                    job.idle.append(worker)
                elif state == "restarting":
                    time.sleep(0.1)  # not up yet: ask again shortly
                    job.probes[job.pool.actors[worker].ready.remote()] = worker
                continue
            worker, run, attempt = job.in_flight.pop(ref)
            entry, worker_ok = _collect(ray, ref, job.pool, worker, run, attempt, max_attempts, job.todo, out_dir,
                                        fingerprint, job.report)
            if worker_ok:
                job.idle.append(worker)
            elif worker not in job.pool.dead:
                # Ray is bringing it back (a new process, the stack loaded again): wait for it,
                # rather than hand it a run it would refuse while restarting.
                job.probes[job.pool.actors[worker].ready.remote()] = worker
            if entry is not None:
                job.report.entries[run.id] = entry
                out.append_manifest(out_dir, [entry])
                if entry["status"] == "complete":
                    job.report.complete += 1
                    job.report.completions += int(entry.get("completions") or 0)
                else:
                    job.report.failed.append(entry)
        if not job.pool.alive() and job.todo:
            for run, attempt in job.todo:
                entry = {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt - 1,
                         "error": "no worker could start (see the worker errors above)"}
                job.report.entries[run.id] = entry
                job.report.failed.append(entry)
            out.append_manifest(out_dir, [job.report.entries[r.id] for r, _ in job.todo])
            job.todo.clear()
        _show_progress(ray, job, on_progress, stream)


def _show_progress(ray: Any, job: _Job, on_progress: ProgressHook | None, stream: TextIO | None) -> None:
    """Give `on_progress` the board's latest snapshot and, when due, print runs done, completions/s and the ETA."""
    now = time.monotonic()
    # A line every 2 s while runs finish, every 15 s while workers load or score long runs.
    done_runs = job.report.complete + len(job.report.failed)
    due = stream is not None and now - job.last_print >= (2.0 if done_runs != job.last_done else 15.0)
    if on_progress is not None or due:
        # Never wait on the board: use the latest snapshot it has answered.
        if ray.wait([job.snapshot_ref], timeout=0)[0]:
            job.snap = ray.get(job.snapshot_ref)
            job.snapshot_ref = job.pool.progress.snapshot.remote(job.id)
        current = {wr[1].id: (wr[2], wr[0]) for wr in job.in_flight.values()}
        partial = sum(s["completions"] for rid, s in job.snap.items()
                      if rid in current and s["attempt"] == current[rid][0])
        elapsed = now - job.started
        rate = (job.report.completions + partial) / elapsed if elapsed > 0 else 0.0
        # Per run, the mean of the runs this call completed (the report counts only those).
        per_run = job.report.completions / job.report.complete if job.report.complete else math.nan
        left = (job.n_todo - done_runs) * per_run - partial
        eta = left / rate if rate > 0 else math.nan
        if on_progress is not None:
            on_progress({"runs_done": done_runs, "runs_todo": job.n_todo, "completions_per_s": rate,
                         "eta_s": eta, "in_flight": {rid: job.snap.get(rid) for rid in current},
                         "workers": {rid: w for rid, (_, w) in current.items()}})
        if due:
            job.last_print, job.last_done = now, done_runs
            _say(stream, f"rescore: {done_runs}/{job.n_todo} runs done ({len(job.report.failed)} failed), "
                         f"{rate:.1f} completions/s, ETA {_eta(eta)}")


def _probe(ray: Any, ref: Any, pool: RescorePool, worker: int) -> str:
    """`alive`, `restarting` or `dead` (its constructor failed), from a `ready()` call."""
    from ray.exceptions import RayActorError

    try:
        ray.get(ref)
        return "alive"
    except RayActorError as e:
        if getattr(e, "actor_init_failed", False):
            log.error("worker %d could not start again: %s", worker, e)
            pool.dead.add(worker)
            return "dead"
        return "restarting"


def _collect(ray: Any, ref: Any, pool: RescorePool, worker: int, run: Run, attempt: int, max_attempts: int,
             todo: deque, out_dir: Path, fingerprint: str,
             report: RescoreReport) -> tuple[dict[str, Any] | None, bool]:
    """(the manifest entry of a finished task or None when the run goes back in the queue, whether
    the worker is still alive)."""
    from ray.exceptions import RayActorError

    try:
        return ray.get(ref), True
    except RayActorError as e:
        if getattr(e, "actor_init_failed", False):
            # The constructor raised (bad model path on that node, ...): Ray will not restart it.
            log.error("worker %d could not start: %s", worker, e)
            pool.dead.add(worker)
            todo.appendleft((run, attempt))  # not this run's fault
            return None, False
        path = out.output_path(out_dir, run.id)
        if _is_complete(run, path, fingerprint):
            # It died after the rename: the table is whole.
            meta = out.read_meta(path) or {}
            return {"run": run.id, "input": run.path, "status": "complete", "attempts": attempt, "output": path.name,
                    **{k: meta.get(k) for k in ("steps", "completions", "bad_records")}}, False
        if attempt < max_attempts:
            log.warning("worker %d died during run %s (attempt %d); Ray replaces it and the run restarts "
                        "from scratch", worker, run.path, attempt)
            report.restarts += 1
            todo.appendleft((run, attempt + 1))
            return None, False
        return {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt,
                "error": f"its worker died {attempt} times: {str(e).splitlines()[0]}"}, False
    except Exception as e:  # noqa: BLE001 - a task error fails this run, not the job
        return {"run": run.id, "input": run.path, "status": "failed", "attempts": attempt,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}, True


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)
