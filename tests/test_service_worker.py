"""The scoring worker's turn, in process with the fake scorers: packing, order, sequences, commits.

The worker's thread is not started: each test queues jobs and runs one turn (`_process`) itself,
so which jobs share a turn is decided here, not by timing.
"""

from __future__ import annotations

import json
import time

import pytest

from rewardstack._fileio import event_line
from rewardstack._service.errors import ServiceError
from rewardstack._service.worker import Job, Worker
from rewardstack.stack import RewardStack, Step


def _steps(tag: str, n: int) -> list[Step]:
    names = ["augment", "followup0", "answer0", "followup1", "answer1"]
    return [Step.from_dict({"name": names[k % 5], "prompt": f"{tag} prompt {k}", "base_prompt": f"{tag} base",
                            "completions": [f"{tag} text {k} {j}" for j in range(4)] + ["That is an excellent question."]})
            for k in range(n)]


@pytest.fixture
def worker(fake_config) -> Worker:  # noqa: ANN001
    w = Worker(fake_config, queue_size=64, batch_requests=64)
    w.stack = RewardStack(fake_config, load_state=False)
    w.ready = True
    return w


def _turn(worker: Worker) -> None:
    worker._process(worker._take())


def _job(ns: str, step: Step, seq: int | None, deadline: float = 1e18) -> Job:
    return Job(ns, step, seq, deadline=deadline)


def _event(job: Job) -> dict:
    return json.loads(job.future.result(timeout=0).body)


def _one_by_one(stack: RewardStack, steps: list[Step]) -> list[dict]:
    state = stack.new_state()
    return [json.loads(event_line(state.apply(stack.forward(s)).event)) for s in steps]


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in ("step_length", "sequence")} == \
           {k: v for k, v in b.items() if k not in ("step_length", "sequence")}


def test_one_turn_of_two_interleaved_namespaces_equals_scoring_each_alone(worker: Worker) -> None:
    a, b = _steps("a", 6), _steps("b", 6)
    jobs = []
    for k in range(6):  # interleaved in the queue; one turn takes them all
        jobs += [_job("a", a[k], k + 1), _job("b", b[k], None)]
    for j in jobs:
        worker.submit(j)
    _turn(worker)
    ref_a, ref_b = _one_by_one(worker.stack, a), _one_by_one(worker.stack, b)
    got_a = [_event(j) for j in jobs if j.namespace == "a"]
    got_b = [_event(j) for j in jobs if j.namespace == "b"]
    assert all(_same(g, r) for g, r in zip(got_a, ref_a)) and len(got_a) == 6
    assert all(_same(g, r) for g, r in zip(got_b, ref_b)) and len(got_b) == 6
    assert [e["sequence"] for e in got_b] == list(range(1, 7))
    # Committed once per namespace, and a fresh load sees all six.
    for ns in ("a", "b"):
        assert worker.namespaces.get(ns).store.load()["stack"]["steps_scored"] == 6


def test_repeats_duplicates_gaps_and_conflicts(worker: Worker) -> None:
    s = _steps("r", 3)
    first, dup = _job("r", s[0], 1), _job("r", s[0], 1)  # a retry racing its original in one turn
    for j in (first, dup):
        worker.submit(j)
    _turn(worker)
    assert first.future.result().body == dup.future.result().body and dup.future.result().scored is False
    again, gap, other = _job("r", s[0], 1), _job("r", s[2], 3), _job("r", s[1], 1)
    for j in (again, gap, other):
        worker.submit(j)
    _turn(worker)
    assert again.future.result().body == first.future.result().body
    with pytest.raises(ServiceError) as e:
        gap.future.result()
    assert e.value.status == 409 and e.value.type == "sequence_gap" and "expects sequence 2" in e.value.message
    with pytest.raises(ServiceError) as e:
        other.future.result()
    assert e.value.type == "sequence_conflict"
    assert worker.namespaces.get("r").state.sequence == 1


def test_withdrawn_and_expired_jobs_are_never_scored(worker: Worker) -> None:
    s = _steps("d", 3)
    expired, withdrawn, fine = _job("d", s[0], None, deadline=time.monotonic() - 1), _job("d", s[0], None), _job("d", s[0], 1)
    for j in (expired, withdrawn, fine):
        worker.submit(j)
    assert withdrawn.try_cancel()
    _turn(worker)
    with pytest.raises(ServiceError) as e:
        expired.future.result()
    assert e.value.status == 504
    assert not withdrawn.future.done()  # its client has already answered itself
    assert fine.future.result().sequence == 1 and fine.try_cancel() is False  # started: it commits


def test_a_failed_commit_answers_500_and_keeps_memory_equal_to_the_file(worker: Worker, monkeypatch) -> None:  # noqa: ANN001
    s = _steps("c", 2)
    ok = _job("c", s[0], 1)
    worker.submit(ok)
    _turn(worker)
    ns = worker.namespaces.get("c")

    def broken(sections):  # noqa: ANN001, ANN202
        raise OSError("disk full")

    monkeypatch.setattr(ns.store, "save", broken)
    bad = _job("c", s[1], 2)
    worker.submit(bad)
    _turn(worker)
    with pytest.raises(ServiceError) as e:
        bad.future.result()
    assert e.value.status == 500
    assert worker.namespaces.get("c").state.sequence == 1  # reloaded: the step was not applied


def test_close_answers_queued_steps_503(worker: Worker) -> None:
    queued = [_job("z", st, None) for st in _steps("z", 3)]
    for j in queued:
        worker.submit(j)
    worker.begin_drain()
    with pytest.raises(ServiceError):
        worker.submit(_job("z", _steps("z", 1)[0], None))
    worker._close()
    for j in queued:
        with pytest.raises(ServiceError) as e:
            j.future.result()
        assert e.value.status == 503 and e.value.type == "shutting_down"
    assert worker.namespaces.peek("z") is None  # nothing was scored


def test_run_dir_records_every_committed_step(fake_config, tmp_path) -> None:  # noqa: ANN001
    from rewardstack._telemetry.session import Telemetry

    w = Worker(fake_config, queue_size=64, batch_requests=64, run_dir=str(tmp_path / "run"))
    w.stack = RewardStack(fake_config, load_state=False)
    w.telemetry = Telemetry(w.stack, run_dir=w.run_dir, metrics_port=None, settings=fake_config.telemetry)
    w.ready = True
    jobs = [_job("a", s, k + 1) for k, s in enumerate(_steps("a", 3))] + [_job("b", _steps("b", 1)[0], None)]
    for j in jobs:
        w.submit(j)
    _turn(w)
    w._close()
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt"] for x in lines] == [j.step.prompt for j in jobs]
    steps = [json.loads(x) for x in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    # One record per committed step, each with its namespace's index: a's 1-3, then b's first.
    assert [r["step"] for r in steps if r["type"] == "step"] == [1, 2, 3, 1]
