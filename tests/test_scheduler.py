"""The one scheduler of `rewardstack serve`: both lanes admitted under one lock, trainer work in
slices bounded in tokens, a validator's step behind at most one slice, no wake-up lost, and a
burst of thousands of one-sample requests taken whole with every answer its input's alone score.

The real app and worker on a loopback port in this process (tests/test_sessions.py's `Live`), the
validator models faked (tests/fakes.py), a tiny saved HF reward model as `[rewards.tiny]`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from rewardstack._service import batching  # noqa: E402
from rewardstack_client import Client, RetryPolicy  # noqa: E402

from test_sessions import Live, step  # noqa: E402
from test_trainers_mixed import mixed_config  # noqa: E402
from trainer_fixtures import make_tiny_llama_rm, texts  # noqa: E402


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_rm(tmp_path_factory.mktemp("tiny-rm") / "rm")


class Turns:
    """What the worker ran, in order: ("slice", tokens, start, end) and ("steps", start) records."""

    def __init__(self, worker: Any) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple] = []
        run, process, submit = worker.lane.run, worker._process, worker.submit

        def traced_run(stack: Any, pieces: list, *args: Any) -> None:
            t0 = time.monotonic()
            run(stack, pieces, *args)
            tokens = sum(sum(p.job.costs[p.start:p.end]) for p in pieces)
            with self.lock:
                self.log.append(("slice", tokens, t0, time.monotonic()))

        def traced_process(batch: list) -> None:
            with self.lock:
                self.log.append(("steps", time.monotonic()))
            process(batch)

        def traced_submit(job: Any) -> None:
            submit(job)
            if not isinstance(job, batching.StatelessJob):
                with self.lock:
                    self.log.append(("admitted", time.monotonic()))

        worker.lane.run, worker._process, worker.submit = traced_run, traced_process, traced_submit


def test_a_validators_step_waits_for_at_most_one_slice_of_a_trainer_flood(fake_registry, tiny_rm: Path,  # noqa: ANN001
                                                                         tmp_path: Path) -> None:
    """Each step sent while trainers flood the service with large requests is taken after at most
    the one trainer slice that was running when it arrived, and every slice holds at most
    `service.slice_tokens` tokens, however large the trainers' requests are."""
    slice_tokens = 200
    live = Live(mixed_config(tmp_path, tiny_rm, slice_tokens=slice_tokens, batch_wait_s=0.0)).start()
    turns = Turns(live.worker)
    stop = threading.Event()
    inputs = texts(64, seed=9)
    errors: list[BaseException] = []

    def trainer(k: int) -> None:
        try:
            with httpx.Client(base_url=live.url, timeout=300) as c:
                while not stop.is_set():  # large requests: each spans several slices
                    r = c.post("/get_reward", json={"query": inputs[k * 8:k * 8 + 32]})
                    assert r.status_code == 200, r.text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        while not any(r[0] == "slice" for r in turns.log):
            time.sleep(0.01)
        validator = Client(live.url, namespace="v", retry=RetryPolicy(deadline_s=120))
        for k in range(8):
            validator.score(step(f"v{k}"))
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        live.stop()
    assert not errors, errors[:2]
    slices = [r for r in turns.log if r[0] == "slice"]
    assert slices and max(r[1] for r in slices) <= slice_tokens  # the bound holds for every slice
    assert any(r[1] > slice_tokens // 2 for r in slices)  # slices are filled (the bound is what binds)
    starts = [r[1] for r in turns.log if r[0] == "steps"]
    admitted = [r[1] for r in turns.log if r[0] == "admitted"]
    assert len(admitted) >= 8
    for t_sent in admitted:
        taken = next(s for s in starts if s >= t_sent)
        # Slices the step waited for: running when it arrived, or started after it and before its turn.
        ahead = [r for r in slices if r[3] > t_sent and r[2] < taken]
        assert len(ahead) <= 1, (len(ahead), [r[1] for r in ahead])


def test_a_trainer_request_wakes_the_worker_at_once_even_when_the_validators_queue_is_full(
        fake_registry, tiny_rm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """No wake-up is lost: with the idle worker's wait made an hour long, a trainer request sent
    while the validators' queue is full is still answered at once."""
    live = Live(mixed_config(tmp_path, tiny_rm, queue_size=1, batch_wait_s=0.0)).start()
    worker = live.worker
    entered, release = live.hold_forward()
    try:
        validator = Client(live.url, namespace="v", retry=RetryPolicy(deadline_s=60))
        held = threading.Thread(target=validator.score, args=(step("held"),))
        held.start()
        assert entered.wait(30)
        queued = Client(live.url, namespace="w", retry=RetryPolicy(deadline_s=60))
        waiting = threading.Thread(target=queued.score, args=(step("queued"),))
        waiting.start()
        end = time.monotonic() + 30
        while worker.queue_length() < 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        # The validators' queue is full: a trainer request now must not lose its wake-up.
        during: list[int] = []
        trainer = threading.Thread(target=lambda: during.append(
            httpx.post(f"{live.url}/get_reward", json={"query": ["sent while the queue is full"]}, timeout=60).status_code))
        trainer.start()
        time.sleep(0.5)
        release.set()
        for t in (held, waiting, trainer):
            t.join(60)
        assert during == [200]
        # The worker is idle now: make its idle wait an hour, then send trainer requests.
        real_wait = worker._wake.wait
        monkeypatch.setattr(worker._wake, "wait", lambda timeout=None: real_wait(3600 if timeout == 1.0 else timeout))
        time.sleep(1.5)  # the worker enters the hour-long wait
        for q in texts(3, seed=2):
            r = httpx.post(f"{live.url}/get_reward", json={"query": [q]}, timeout=20)
            assert r.status_code == 200, r.text
    finally:
        release.set()
        live.stop()


def test_a_burst_of_4096_one_sample_requests_is_answered_whole_with_alone_scores(fake_registry, tiny_rm: Path,  # noqa: ANN001
                                                                                 tmp_path: Path) -> None:
    """4,096 simultaneous one-sample /get_reward requests from one process at the default bounds:
    none refused, none lost, each the score its text has alone."""
    live = Live(mixed_config(tmp_path, tiny_rm)).start()
    try:
        pool = texts(64, seed=12)
        alone = {q: httpx.post(f"{live.url}/get_reward", json={"query": [q]}, timeout=60).json()["rewards"][0]
                 for q in pool}

        async def burst() -> list[tuple[str, int, Any]]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=live.url, timeout=600, limits=limits) as c:
                async def one(i: int) -> tuple[str, int, Any]:
                    q = pool[i % len(pool)]
                    r = await c.post("/get_reward", json={"query": [q]})
                    return q, r.status_code, r.json()
                return await asyncio.gather(*(one(i) for i in range(4096)))

        answers = asyncio.run(burst())
    finally:
        live.stop()
    codes = [code for _, code, _ in answers]
    assert codes.count(200) == 4096, {c: codes.count(c) for c in set(codes)}
    assert all(body["rewards"][0] == alone[q] for q, _, body in answers)


def test_a_slice_splits_a_large_request_and_keeps_its_order(fake_registry, tiny_rm: Path,  # noqa: ANN001
                                                            tmp_path: Path) -> None:
    """A request larger than a slice is scored over several slices and answered once, its
    rewards in its inputs' order, equal to each input scored alone."""
    live = Live(mixed_config(tmp_path, tiny_rm, slice_tokens=64)).start()
    try:
        queries = texts(20, seed=3)
        alone = [httpx.post(f"{live.url}/get_reward", json={"query": [q]}, timeout=60).json()["rewards"][0]
                 for q in queries]
        before = live.worker.lane.batches
        whole = httpx.post(f"{live.url}/get_reward", json={"query": queries}, timeout=60).json()["rewards"]
        assert live.worker.lane.batches - before > 1  # it did span slices
    finally:
        live.stop()
    assert whole == alone


def test_past_the_token_bound_a_request_is_refused_429_with_retry_after() -> None:
    """Admission counts tokens: a request that would take the waiting tokens past
    `service.max_queued_tokens` is 429 with Retry-After; one that fits is admitted."""
    from rewardstack._settings import ServiceSettings

    lane = batching.Lane(ServiceSettings(max_queued_tokens=100, slice_tokens=50))
    Row = batching.StatelessJob  # noqa: N806

    class Enc:
        def __init__(self, n: int) -> None:
            self.ids = [1] * n

    lane.admit(Row({"m": [Enc(60)]}, deadline=1e18))
    lane.admit(Row({"m": [Enc(40)]}, deadline=1e18))  # exactly at the bound
    with pytest.raises(Exception) as refused:
        lane.admit(Row({"m": [Enc(1)]}, deadline=1e18))
    assert refused.value.status == 429 and "Retry-After" in refused.value.headers
    assert lane.queued_tokens == 100
    pieces = lane.take(time.monotonic())
    assert [(p.start, p.end) for p in pieces] == [(0, 1)] and lane.queued_tokens == 40  # 60 > 50: alone
    lane.admit(Row({"m": [Enc(60)]}, deadline=1e18))  # room again


def test_the_default_bounds_hold_a_trainers_burst_of_4096_requests() -> None:
    """OpenRLHF opens a session (a connection) per request: the service's default connection cap
    (a closed connection is a lost reward after five tries) and token bound hold 4,096 at once."""
    from rewardstack._settings import ServiceSettings

    s = ServiceSettings()
    assert s.max_connections >= 4096 + 64  # the burst, and room for validators and probes
    assert s.stateless_queue >= 4096 and s.max_queued_tokens >= 4096 * 512
