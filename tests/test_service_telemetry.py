"""The service's telemetry: every committed step's record carries its namespace's step index.

The service applies each step to its namespace's own state, never to the stack's; the records
must still name the step, and the leak alarms (memory at rest is the process's, one series for
every namespace) must see steps that advance, or a leak in `serve` could never trip them.
The worker's thread is not started: each test queues jobs and runs the turns itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from rewardstack._service.worker import Job, Worker
from rewardstack.stack import RewardStack, Step
from rewardstack._telemetry.session import Telemetry
from telemetry_fixtures import HogScorer, hog_config, step  # noqa: F401 - fixture

MIB = 1024**2


def _worker(config, run_dir: Path) -> Worker:  # noqa: ANN001
    w = Worker(config, queue_size=64, batch_requests=64, run_dir=str(run_dir))
    w.stack = RewardStack(config, load_state=False)
    w.telemetry = Telemetry(w.stack, run_dir=w.run_dir, metrics_port=None, settings=config.telemetry)
    w.ready = True
    return w


def _turn(w: Worker, *jobs: Job) -> None:
    for j in jobs:
        w.submit(j)
    w._process(w._take())
    for j in jobs:
        assert j.future.result(timeout=0).scored


def _timeline(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]


def test_records_of_four_committed_steps_have_increasing_indices(hog_config, tmp_path) -> None:  # noqa: ANN001
    w = _worker(hog_config(), tmp_path / "run")
    _turn(w, *(Job("a", Step.from_dict(step(k)), k + 1, deadline=1e18) for k in range(4)))  # one turn, four steps
    _turn(w, Job("a", Step.from_dict(step(4)), None, deadline=1e18))
    w._close()
    records = _timeline(tmp_path / "run")
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3, 4, 5]
    # The calls are attributed to a step that exists (never a step 0 no namespace committed).
    assert {r["step"] for r in records if r["type"] == "call"} <= {1, 2, 3, 4, 5}


def _leak_config(hog_config, window: int):  # noqa: ANN001, ANN202
    HogScorer.leak_per_step = 2 * MIB  # kept on the simulated device after every scored step
    return hog_config(telemetry={"leak_window": window, "leak_warmup": 2, "leak_bytes_per_step": MIB})


def test_a_leak_in_a_service_run_trips_the_leak_alarm(hog_config, tmp_path) -> None:  # noqa: ANN001
    window = 8
    w = _worker(_leak_config(hog_config, window), tmp_path / "run")
    for k in range(2 + window + 3):  # one step per turn, as a validator sends them
        _turn(w, Job("a", Step.from_dict(step(k)), k + 1, deadline=1e18))
    w._close()
    records = _timeline(tmp_path / "run")
    tripped = [r["step"] for r in records if r["type"] == "step" and "device_allocated" in r["alarms"]]
    assert tripped == [2 + window]  # the first step the window is full, and only once
    alarm = [r for r in records if r["type"] == "alarm" and r["series"] == "device_allocated"]
    assert len(alarm) == 1 and alarm[0]["slope"] > MIB


def test_a_leak_trips_the_alarm_over_namespaces_at_different_sequence_numbers(hog_config, tmp_path) -> None:  # noqa: ANN001
    # Namespace "a" resumes at step 101 while "b" starts at 1, their steps interleaved: the leak
    # grows with the process's steps, whatever each namespace calls them.
    window = 8
    w = _worker(_leak_config(hog_config, window), tmp_path / "run")
    w.namespaces.get("a").state.steps_scored = 100
    for k in range(2 + window + 3):
        _turn(w, Job("ab"[k % 2], Step.from_dict(step(k)), None, deadline=1e18))
    w._close()
    records = _timeline(tmp_path / "run")
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps][:4] == [101, 1, 102, 2]  # each namespace's own index
    assert sum("device_allocated" in r["alarms"] for r in steps) == 1
    assert "device_allocated" in steps[2 + window - 1]["alarms"]  # the process's step 2 + window
