"""A validator is never stuck and never doubled: sessions fence the old writer, refused numbers are
never resent, a wiped service is resumed with one warning, Ctrl-C ends a waiting call.

The service is the real app and worker (`create_app`) on a loopback port, in this process, over the
fake scorers (tests/fakes.py), so each case controls when a forward pass finishes; the client is
`rewardstack_client`, over real HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from rewardstack._service.app import create_app  # noqa: E402
from rewardstack._service.access import Access  # noqa: E402
from rewardstack_client import Client, Fenced, RetryPolicy  # noqa: E402

from service_fixtures import free_port  # noqa: E402

FAST = RetryPolicy(deadline_s=30, backoff_s=0.05, max_backoff_s=0.2)
CLIENT_DIR = Path(__file__).resolve().parents[1] / "clients" / "python"


def step(tag: str) -> dict[str, Any]:
    return {"name": "augment", "prompt": f"prompt {tag}?", "completions": [f"{tag} one", f"{tag} two"]}


class Live:
    """The service (real app, fake scorers) on a loopback port; stop and start it again on the same port."""

    def __init__(self, config: Any, access: Access | None = None) -> None:
        self.config = config
        self.access = access or Access({})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.app: Any = None

    def start(self) -> "Live":
        self.app = create_app(self.config, self.config.service, self.access)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 60
        while not (self.server.started and self.worker.ready):
            assert time.monotonic() < end, self.worker.error
            time.sleep(0.02)
        return self

    @property
    def worker(self) -> Any:
        return self.app.state.worker

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            assert self.thread is not None
            self.thread.join(30)
            self.server = None

    def standing(self, namespace: str) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/namespaces/{namespace}", timeout=30).json()

    def hold_forward(self) -> tuple[threading.Event, threading.Event]:
        """Hold the next forward pass: (entered, release)."""
        entered, release = threading.Event(), threading.Event()
        stack = self.worker.stack
        original = stack.forward_many

        def held(steps: Any) -> Any:
            entered.set()
            release.wait(30)
            stack.forward_many = original
            return original(steps)

        stack.forward_many = held
        return entered, release


@pytest.fixture
def live(fake_config) -> Any:  # noqa: ANN001
    service = Live(fake_config).start()
    yield service
    service.stop()


def sent_sequences(client: Client) -> list[int]:
    """Record the sequence number of every step `client` sends from now on."""
    seen: list[int] = []

    def hook(request: httpx.Request) -> None:
        if request.url.path == "/v1/score":
            seen.append(json.loads(request.content)["sequence"])

    client.http.event_hooks["request"].append(hook)
    return seen


def kept_prompts(live: Live, namespace: str) -> dict[int, str]:
    """The prompt of every step the namespace committed and still keeps, by sequence."""
    state = next(ns.state for ns in live.worker.namespaces.loaded() if ns.name == namespace)
    return {seq: json.loads(kept.split("\n")[0])["prompt"] for seq, kept in state.recent.items()}


def test_a_restarted_validator_takes_over_after_the_step_in_flight_commits(live: Live) -> None:
    first = Client(live.url, namespace="v", retry=FAST, name="validator-before-kill")
    first.score(step("a1"))
    first.score(step("a2"))
    entered, release = live.hold_forward()
    in_flight = threading.Thread(target=lambda: first.score(step("a3")), daemon=True)  # killed while scoring
    in_flight.start()
    assert entered.wait(30)
    restarted = Client(live.url, namespace="v", retry=FAST, name="validator-after-restart")
    sent = sent_sequences(restarted)
    opened: dict[str, Any] = {}
    opener = threading.Thread(target=lambda: opened.update(restarted.open_session()))
    opener.start()
    time.sleep(0.3)
    assert not opened  # the session waits for the step in flight: committed or refused first
    release.set()
    opener.join(30)
    in_flight.join(30)
    assert opened["next"] == 4 and opened["previous"]["client"] == "validator-before-kill"
    events = [restarted.score(step(f"b{i}")) for i in (4, 5)]
    assert [e["sequence"] for e in events] == [4, 5] and sent == [4, 5]  # never a refused number
    assert kept_prompts(live, "v") == {1: "prompt a1?", 2: "prompt a2?", 3: "prompt a3?", 4: "prompt b4?",
                                       5: "prompt b5?"}


def test_after_a_refused_number_the_client_resyncs_and_never_resends_it(live: Live) -> None:
    writer = Client(live.url, namespace="r", retry=FAST)
    for k in range(3):
        writer.score(step(f"r{k}"))
    writer._writer.next = 2  # as if it had read the number before two steps committed
    sent = sent_sequences(writer)
    event = writer.score(step("r-new"))
    assert event["sequence"] == 4 and sent == [2, 4]  # refused once (another step holds 2), then the next
    assert writer.score(step("r-after"))["sequence"] == 5
    assert kept_prompts(live, "r")[2] == "prompt r1?"


def test_a_second_writer_fences_the_first_within_one_step(live: Live) -> None:
    first = Client(live.url, namespace="dup", retry=FAST, name="validator-one")
    second = Client(live.url, namespace="dup", retry=FAST, name="validator-two")
    first.score(step("one-1"))
    first.score(step("one-2"))
    second.score(step("two-3"))  # opens a session: the first is fenced
    with pytest.raises(Fenced) as fenced:
        first.score(step("one-4"))
    assert fenced.value.status == 409 and "validator-two" in fenced.value.message and str(os.getpid()) in fenced.value.message
    # Even with the very number the namespace expects next, a step of the old session is refused.
    stale = httpx.post(f"{live.url}/v1/score", json={**step("one-4"), "namespace": "dup", "sequence": 4,
                                                      "epoch": first.epoch}, timeout=30)
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "fenced", stale.text
    assert second.score(step("two-4"))["sequence"] == 4
    assert kept_prompts(live, "dup") == {1: "prompt one-1?", 2: "prompt one-2?", 3: "prompt two-3?", 4: "prompt two-4?"}
    # The first restarted by a process manager takes the namespace back: now the second is fenced, loudly.
    restarted = Client(live.url, namespace="dup", retry=FAST, name="validator-one")
    assert restarted.score(step("one-5"))["sequence"] == 5
    with pytest.raises(Fenced, match="validator-one"):
        second.score(step("two-6"))
    assert live.standing("dup")["holder"]["client"] == "validator-one"


def test_a_service_whose_state_was_wiped_is_resumed_with_one_warning(
        fake_config, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    service = Live(fake_config).start()
    try:
        c = Client(service.url, namespace="w", retry=FAST)
        for k in range(3):
            c.score(step(f"w{k}"))
        service.stop()
        shutil.rmtree(fake_config.state_dir)  # a wiped state folder (or a new box)
        service.start()
        with caplog.at_level(logging.WARNING, logger="rewardstack_client"):
            resumed = [c.score(step(f"w-again{k}"))["sequence"] for k in range(3)]
        assert resumed == [1, 2, 3]  # the service's numbering, from its fresh state
        resets = [r for r in caplog.records if "was reset" in r.getMessage()]
        assert len(resets) == 1, [r.getMessage() for r in caplog.records]
    finally:
        service.stop()


def test_unknown_fields_are_a_422_naming_the_closest_field(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/score", json={**step("s"), "namespace": "typo", "sequnce": 1}, timeout=30)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "sequnce" and "'sequence'" in error["message"]
    r = httpx.post(f"{live.url}/v1/score", json={**step("s"), "base_promt": "b"}, timeout=30)
    assert r.status_code == 422 and "'base_prompt'" in r.json()["error"]["message"]
    assert live.standing("typo")["sequence"] == 0  # nothing applied
    r = httpx.post(f"{live.url}/v1/namespaces/typo/sessions", json={"clinet": "x"}, timeout=30)
    assert r.status_code == 422 and "'client'" in r.json()["error"]["message"]


def test_a_retry_answered_from_the_store_carries_the_memory_record(live: Live) -> None:
    body = {**step("m"), "namespace": "mem", "sequence": 1}
    first = httpx.post(f"{live.url}/v1/score", json=body, timeout=30)
    again = httpx.post(f"{live.url}/v1/score", json=body, timeout=30)
    assert first.headers["x-rewardstack-scored"] == "true" and again.headers["x-rewardstack-scored"] == "false"
    assert again.text == first.text
    assert json.loads(again.headers["x-rewardstack-memory"]) == json.loads(first.headers["x-rewardstack-memory"])


CTRL_C = """
import asyncio, sys, time
from rewardstack_client import Client, RetryPolicy
from rewardstack_client.openvalidators import OpenValidatorsStack
client = Client(sys.argv[1], namespace="gone", retry=RetryPolicy(deadline_s=900, max_backoff_s=0.5))
rs = OpenValidatorsStack(client.score, {}, [], wandb=None)
print("waiting", flush=True)
if sys.argv[2] == "score_step":
    asyncio.run(rs.score_step("p?", ["a", "b"], "augment"))
else:
    client.score({"name": "augment", "prompt": "p?", "completions": ["a", "b"]})
"""


@pytest.mark.parametrize("how", ["score_step", "score"])
def test_ctrl_c_ends_a_call_waiting_for_a_service_that_is_down_within_a_second(how: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(CLIENT_DIR)}
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, f"http://127.0.0.1:{free_port()}", how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
    time.sleep(1.5)  # retrying: the connection is refused
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr.read()
    assert took < 1.0, f"{took:.2f} s from Ctrl-C to exit"


def test_the_deadline_is_not_overshot_by_a_request_that_hangs() -> None:
    import socket

    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        c = Client(url, namespace="slow", timeout=120.0, retry=RetryPolicy(deadline_s=2.0, max_backoff_s=0.2))
        outcome: list[BaseException] = []
        started = time.monotonic()
        worker = threading.Thread(target=lambda: _catch(outcome, lambda: c.score(step("x"))), daemon=True)
        worker.start()
        worker.join(10)
        took = time.monotonic() - started
    assert not worker.is_alive() and took < 3.0, f"{took:.1f} s for a 2 s deadline"
    assert outcome and type(outcome[0]).__name__ == "ServiceUnavailable"


def _catch(into: list[BaseException], call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test reads it
        into.append(e)


def test_a_bad_namespace_is_refused_before_anything_is_sent() -> None:
    from rewardstack_client import ClientError, InvalidNamespace

    for bad in ("a?b=c", "a\r\nb", "../x", "", "x" * 65):
        with pytest.raises(InvalidNamespace) as e:
            Client("http://127.0.0.1:1", namespace=bad)
        assert isinstance(e.value, ClientError) and isinstance(e.value, ValueError)
