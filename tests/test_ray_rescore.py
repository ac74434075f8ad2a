"""`rewardstack rescore` on a local 2-CPU Ray cluster with the tiny stand-in stack.

One cluster (shared with test_ray_serve.py: tests/ray_fixtures.py) serves the whole module (each
start costs seconds); each rescore runs two workers on it. The tiny stand-ins (one layer, width 16)
run the same code paths at a fraction of the arithmetic; what is tested is the machinery. The
reference is each run scored alone by a freshly built stack, independent of the workers' reuse of
one loaded stack across runs.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ray_fixtures import shared_cluster, standins_config, write_runs
from rewardstack._distributed import output as out
from rewardstack._distributed.runs import discover_runs
from rewardstack.errors import ConfigError
from rewardstack._replay import readers
from rewardstack._replay.replay import replay
from rewardstack.stack import RewardStack

ray = pytest.importorskip("ray")
from rewardstack._distributed.rescore import rescore  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def cluster(request):  # noqa: ANN001, ANN201
    yield from shared_cluster(request)


@pytest.fixture(scope="module")
def setup(cluster, tiny_standins, tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("rescore")
    config = standins_config(tiny_standins, root / "state")
    write_runs(root / "runs", 3)
    runs = discover_runs([root / "runs"])
    RewardStack(config, load_state=False)  # calibrates once, into the home's cache the workers read
    yield root, config, runs, {run.id: scored_alone(config, run) for run in runs}


def scored_alone(config, run) -> list[dict]:  # noqa: ANN001
    """The rows of `run` replayed alone by a fresh stack in this process."""
    stack = RewardStack(config, load_state=False)
    events: list[dict] = []
    replay(stack, readers.read_run([run.path]).steps, reference=False, on_event=events.append)
    return [row for index, event in enumerate(events) for row in out.rows_from_event(index, event)]


def assert_equal_tables(table_path: Path, expected: list[dict]) -> None:
    got = pq.read_table(table_path).to_pylist()
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key, value in e.items():
            if isinstance(value, float):
                # Worker and test differ in torch threads, so in reduction order: float noise only.
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            else:
                assert g[key] == value, key


def test_rescore_equals_each_run_scored_alone(setup) -> None:  # noqa: ANN001
    root, config, runs, alone = setup
    report = rescore(runs, config, root / "out", workers=2, stream=None)
    assert report.ok and report.complete == 3 and report.skipped == 0
    for run in runs:
        assert_equal_tables(out.output_path(root / "out", run.id), alone[run.id])
    bad = report.entries[runs[1].id]
    assert bad["bad_records"] == 1 and bad["steps"] == 5 and "line 4" in bad["bad"][0]
    failed_rows = [r for r in alone[runs[1].id] if r["status"] == "failed"]
    assert len(failed_rows) == 1 and failed_rows[0]["rlhf_reward_model"] is None
    assert {e["run"] for e in out.read_manifest(root / "out").values()} == {r.id for r in runs}
    assert not list((root / "out").glob("*.tmp"))


def test_rerun_does_nothing_and_a_changed_run_is_scored_again(setup) -> None:  # noqa: ANN001
    root, config, runs, alone = setup
    # Its own copy of the runs and its own output (it changes a run): it passes alone and in any order.
    import shutil

    shutil.copytree(root / "runs", root / "rerun-runs")
    copies = discover_runs([root / "rerun-runs"])
    original = {Path(r.path).name: r.id for r in runs}
    expected = {c.id: alone[original[Path(c.path).name]] for c in copies}
    first = rescore(copies, config, root / "rerun-out", workers=2, stream=None)
    assert first.ok and first.complete == 3
    tables = {r.id: out.output_path(root / "rerun-out", r.id) for r in copies}
    before = {k: p.stat().st_mtime_ns for k, p in tables.items()}
    manifest_lines = (root / "rerun-out" / out.MANIFEST).read_text().count("\n")
    report = rescore(copies, config, root / "rerun-out", stream=None)  # nothing to do: no worker starts
    assert report.ok and report.skipped == 3 and report.complete == 0
    assert {k: p.stat().st_mtime_ns for k, p in tables.items()} == before
    assert (root / "rerun-out" / out.MANIFEST).read_text().count("\n") == manifest_lines
    # A torn manifest line (a killed driver) does not hide what the tables say.
    with open(root / "rerun-out" / out.MANIFEST, "a") as f:
        f.write('{"run": "torn')
    # Run 2's file now holds run 0's steps: it is scored again, and only it.
    Path(copies[2].path).write_text(Path(copies[0].path).read_text())
    report = rescore(copies, config, root / "rerun-out", workers=2, stream=None)
    assert report.skipped == 2 and report.complete == 1 and copies[2].id in report.entries
    assert tables[copies[0].id].stat().st_mtime_ns == before[copies[0].id]
    assert_equal_tables(tables[copies[2].id], expected[copies[0].id])


def test_a_worker_killed_mid_run_is_replaced_and_the_run_restarted(setup) -> None:  # noqa: ANN001
    root, config, _, _ = setup
    # Long enough that the worker is still scoring when the kill lands: the progress snapshot lags
    # the worker by up to a report interval, and a kill that arrives after the run finished
    # restarts nothing (seen in CI with 12 steps of 4, 0.06 s a run). The kill lands at step 2 or
    # soon after and at most at step 11, so at least 12 steps of 8 (over a second of scoring on the
    # tiny stack) are still to come. (40 steps of 24, then of 8 on the standard stand-ins until
    # 2026-12-03; 24 steps of 8 on the tiny stand-ins seen red with `max_attempts=1`: no restart.)
    n_steps = 24
    write_runs(root / "long", 2, n_steps=n_steps, n_completions=8)
    runs = discover_runs([root / "long"])
    killed: dict[str, int] = {}

    def kill_a_busy_worker(snapshot: dict) -> None:
        if killed:
            return
        for run_id, state in snapshot["in_flight"].items():
            if state and state["attempt"] == 1 and 2 <= state["steps"] < n_steps // 2:  # some steps scored
                os.kill(state["worker"]["pid"], signal.SIGKILL)  # the worker process dies mid-run
                killed[run_id] = state["steps"]
                return

    report = rescore(runs, config, root / "long-killed", workers=2, stream=None, on_progress=kill_a_busy_worker,
                     progress_interval_s=0.05)
    assert killed, "no worker was caught mid-run"
    (run_id,) = killed
    assert report.ok and report.complete == 2 and report.restarts == 1
    assert report.entries[run_id]["attempts"] == 2
    for run in runs:  # nothing of the killed attempt leaks into the restarted one
        assert_equal_tables(out.output_path(root / "long-killed", run.id), scored_alone(config, run))
    assert not list((root / "long-killed").glob("*.tmp"))


def test_a_run_past_its_attempts_is_failed_not_scored_again(setup) -> None:  # noqa: ANN001
    """The board counts a run's starts; the start past `max_attempts` (its worker died each time)
    records the run as failed without scoring it (no stack is touched here)."""
    from rewardstack._distributed.progress import RescoreProgress
    from rewardstack._distributed.rescore import RescoreWorker

    root, _, runs, _ = setup
    board = ray.remote(RescoreProgress).options(num_cpus=0).remote()
    worker = object.__new__(RescoreWorker)  # its stack is never used on this path
    worker.identity, worker.out_dir, worker.fingerprint, worker.progress = {"pid": 1}, root / "attempts", "f", board
    worker.max_attempts, worker.interval_s = 2, 1.0
    for _ in range(2):  # two starts whose worker died
        ray.get(board.start.remote(runs[0].id, {"pid": 0}))
    entry = worker.score_run(runs[0])
    assert entry["status"] == "failed" and entry["attempts"] == 2 and "died 2 times" in entry["error"]
    assert not (root / "attempts").exists()
    ray.kill(board)


def test_output_folder_of_another_config_is_refused(tmp_path: Path) -> None:
    out.claim_output(tmp_path, "aaaa")
    out.claim_output(tmp_path, "aaaa")
    with pytest.raises(ConfigError, match="another config"):
        out.claim_output(tmp_path, "bbbb")


def test_runs_are_discovered_once_each(tmp_path: Path) -> None:
    paths = write_runs(tmp_path / "a", 2, n_steps=3)
    (tmp_path / "list.txt").write_text(f"# runs\n{paths[0]}\n")
    log_dir = tmp_path / "validator"
    log_dir.mkdir()
    (log_dir / "completions.log").write_text("")
    (log_dir / "completions.2023-07-01_10-00-00_1.log.gz").write_bytes(b"")
    runs = discover_runs([tmp_path / "a", paths[1], log_dir], list_files=[tmp_path / "list.txt"])
    assert [Path(r.path).name for r in runs] == ["run0.jsonl", "run1.jsonl", "validator"]
    assert len(runs[2].files) == 2 and len({r.id for r in runs}) == 3
