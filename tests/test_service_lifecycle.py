"""The service's deadlines and shutdown over real HTTP (a `rewardstack serve` subprocess).

Work whose deadline passes, or whose client goes away, before it starts is never scored. SIGTERM
with work queued: the running step commits, queued ones get 503, the process exits 0, and a
restart on the same state holds every committed step once and none of the refused ones.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from service_fixtures import Server, text_steps, write_config  # noqa: E402


def heavy_steps(tag: str, n: int) -> list[dict[str, Any]]:
    """Steps with long completions: each keeps the worker busy for a while."""
    steps = text_steps(tag, n, width=8)
    for s in steps:
        s["completions"] = [(c + " ") * 10 for c in s["completions"]]
        s.pop("failed", None)
    return steps


@pytest.fixture(scope="module")
def config(standins: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(standins, tmp_path_factory.mktemp("service_life") / "state", "life", batch_requests=1, deadline_s=900.0)


def wait_until(fn, timeout: float = 120.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def sequence(url: str, ns: str) -> int:
    return httpx.get(f"{url}/v1/namespaces/{ns}", timeout=60).json()["sequence"]


def post_in_background(url: str, body: dict, out: dict, key: str, timeout: float = 600) -> threading.Thread:
    def send() -> None:
        try:
            out[key] = httpx.post(f"{url}/v1/score", json=body, timeout=timeout)
        except httpx.TransportError as e:
            out[key] = e

    t = threading.Thread(target=send)
    t.start()
    return t


def test_deadlines_and_shutdown_with_work_queued(config: Path) -> None:
    server = Server(config).start().wait_ready()
    try:
        url = server.url
        busy = heavy_steps("slow", 3)
        out: dict[str, Any] = {}
        threads = [post_in_background(url, {**s, "namespace": f"slow{i}", "sequence": 1}, out, f"b{i}")
                   for i, s in enumerate(busy)]
        wait_until(lambda: (httpx.get(url + "/healthz").json()["running"] or "").startswith("forward pass"))
        # /healthz answers at once while the worker is busy: it never waits behind the queue.
        t0 = time.monotonic()
        assert httpx.get(url + "/healthz", timeout=5).json()["status"] == "ok"
        assert time.monotonic() - t0 < 2.0
        # A short deadline that passes while the worker is busy: answered 504 and never scored.
        quick = {"name": "augment", "prompt": "quick?", "completions": ["a quick one", "another"], "namespace": "quick"}
        r = httpx.post(url + "/v1/score", json=quick, headers={"X-Rewardstack-Deadline-S": "0.05"}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
        # A client that goes away before its step starts: never scored either.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/score", json={**quick, "namespace": "gone"}, timeout=0.2)
        for t in threads:
            t.join()
        assert [out[f"b{i}"].status_code for i in range(3)] == [200, 200, 200]
        wait_until(lambda: httpx.get(url + "/healthz").json()["running"] is None)
        assert sequence(url, "quick") == 0 and sequence(url, "gone") == 0
        assert [sequence(url, f"slow{i}") for i in range(3)] == [1, 1, 1]

        # SIGTERM with work queued: one namespace per step, so any arrival order is in order.
        steps = heavy_steps("term", 6)
        out = {}
        threads = [post_in_background(url, {**s, "namespace": f"t{i}", "sequence": 1}, out, f"t{i}")
                   for i, s in enumerate(steps)]
        wait_until(lambda: httpx.get(url + "/healthz").json()["queue_length"] >= 3)
        assert server.terminate() == 0
        for t in threads:
            t.join()
    finally:
        server.stop()
    codes = {k: (v.status_code if isinstance(v, httpx.Response) else "transport") for k, v in out.items()}
    assert set(codes.values()) <= {200, 503}, codes
    refused = [k for k, c in codes.items() if c == 503]
    scored = [k for k, c in codes.items() if c == 200]
    assert refused and scored, codes
    assert all(out[k].json()["error"]["type"] == "shutting_down" for k in refused)

    # Restart on the same state: every namespace resumes where it was committed.
    server = Server(config).start().wait_ready()
    try:
        url = server.url
        assert [sequence(url, f"slow{i}") for i in range(3)] == [1, 1, 1]
        for i in range(6):
            assert sequence(url, f"t{i}") == (1 if f"t{i}" in scored else 0), (i, codes)
        for i, s in enumerate(steps):  # the client's retry after the restart, same sequence number
            r = httpx.post(url + "/v1/score", json={**s, "namespace": f"t{i}", "sequence": 1}, timeout=600)
            assert r.status_code == 200
            if f"t{i}" in scored:  # committed before the shutdown: the stored answer, not scored again
                assert r.headers["x-rewardstack-scored"] == "false" and r.content == out[f"t{i}"].content
            else:
                assert r.headers["x-rewardstack-scored"] == "true"
            assert sequence(url, f"t{i}") == 1
    finally:
        assert server.terminate() == 0
