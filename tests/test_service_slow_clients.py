"""Clients that hold connections open (issue 33 #3): header and body timeouts, the connection cap,
logs that cannot flood, and a SIGTERM that drains within a bounded time.

The first tests run the app on the fake scorers under uvicorn in a thread, configured exactly as
`rewardstack serve` configures it (`connections.server_config`), and talk raw sockets to it; the
last runs `rewardstack serve` itself under an open-file limit of 256.
"""

from __future__ import annotations

import logging
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from rewardstack._service.edge import RepeatFilter, server_config  # noqa: E402

from service_fixtures import Server, free_port, write_config  # noqa: E402

HEADER_S, BODY_S = 1.0, 1.5


@pytest.fixture
def live(fake_config) -> Iterator[tuple[str, int]]:  # noqa: ANN001
    """The app on the fake scorers under uvicorn, in a thread, with short timeouts and a cap of 8."""
    import uvicorn

    from rewardstack._service.app import create_app
    from rewardstack._service.access import Access

    s = fake_config.service
    s.port, s.header_timeout_s, s.body_timeout_s, s.max_connections = free_port(), HEADER_S, BODY_S, 8
    app = create_app(fake_config, s, Access({}))
    server = uvicorn.Server(server_config(app, s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{s.port}"
    end = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, "the server did not get ready"
        time.sleep(0.05)
    try:
        yield url, s.port
    finally:
        server.should_exit = True
        thread.join(60)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes `sock` (None if still open after `seconds`), sending one
    byte of `trickle` every 0.2 s meanwhile."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - t0
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - t0
            sent += 1
    return None


def test_idle_and_slow_header_connections_are_closed(live) -> None:  # noqa: ANN001
    _, port = live
    idle = _connect(port)
    assert (_closed_within(idle, 6.0) or 99) < HEADER_S + 1.5
    slow = _connect(port)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert (_closed_within(slow, 6.0, trickle=b"X-Slow: " + b"a" * 100) or 99) < HEADER_S + 1.5
    # A keep-alive connection gets the same time again for its next request's headers.
    kept = _connect(port)
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    kept.settimeout(10)
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /healthz HTTP/1.1\r\n")
    assert (_closed_within(kept, 8.0, trickle=b"X-Slow: " + b"a" * 100) or 99) < 6.0


def test_a_slow_body_is_408_and_closed(live) -> None:  # noqa: ANN001
    _, port = live
    sock = _connect(port)
    sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n{")
    t0 = time.monotonic()
    answer = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < 8.0:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            sock.sendall(b" ")  # one byte every 0.2 s: never idle, never done
            continue
        if not chunk:
            break
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"body_timeout"' in answer and time.monotonic() - t0 < BODY_S + 2.0


def test_connections_past_the_cap_are_closed_at_once_and_the_service_recovers(live) -> None:  # noqa: ANN001
    url, port = live
    socks = [_connect(port) for _ in range(30)]
    time.sleep(0.3)
    shut_at_once = sum(_closed_within(s, 0.3) is not None for s in socks)
    assert shut_at_once >= 30 - 8, shut_at_once
    # The ones within the cap go at the header timeout; then a real client is served.
    end = time.monotonic() + HEADER_S + 5
    while True:
        try:
            r = httpx.get(url + "/healthz", timeout=5)
            break
        except httpx.TransportError:
            assert time.monotonic() < end, "the service did not recover from the held connections"
            time.sleep(0.1)
    assert r.status_code == 200
    for s in socks:
        s.close()


def test_a_repeated_message_is_logged_once_per_window() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    now = [100.0]  # a stepped clock: however slow the machine, the flood is inside one window
    handler = Keep()
    repeat = RepeatFilter(window_s=0.5, clock=lambda: now[0])
    handler.addFilter(repeat)
    # Records go straight to the handler, as a logger hands them on: the filter under test is the
    # handler's, and the process's logging state (levels, `logging.disable`) that other tests in
    # this worker may have left behind cannot drop a record (CI: the warning below went missing).
    logger = logging.getLogger("rewardstack.test.repeat")

    def log(level: int, msg: str, *args: Any, exc_info: Any = None) -> None:
        handler.handle(logger.makeRecord(logger.name, level, __file__, 0, msg, args, exc_info))

    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            log(logging.ERROR, "socket.accept() out of system resource (%d)", i, exc_info=sys.exc_info())
    log(logging.WARNING, "another message")
    now[0] += 0.6
    log(logging.ERROR, "socket.accept() out of system resource (%d)", -1)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 3, messages[:5]
    assert messages[1] == "another message"
    assert "9999 more like this" in messages[2]  # the next one that passes says how many were held back


def test_serve_takes_its_filter_off_the_process_handlers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`serve` run in a process that has logging of its own (here pytest's capture handler on the
    root) leaves no RepeatFilter behind: it held back the warnings of the tests after it (CI)."""
    from rewardstack.cli import main

    config = tmp_path / "stack.toml"  # the default models: the 3B one needs `rewardstack download` and fails at load
    config.write_text(f'device = "cpu"\nstate_dir = "{tmp_path / "state"}"\n')
    handlers = list(logging.getLogger().handlers)
    assert handlers  # pytest's
    assert main(["serve", "--config", str(config), "--port", str(free_port())]) == 1
    assert "the stack failed to load" in capsys.readouterr().err
    assert [f for h in handlers for f in h.filters if isinstance(f, RepeatFilter)] == []


def _fd_limit(n: int) -> Any:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return limit


@pytest.mark.slow
def test_the_service_holds_under_400_slow_clients_and_drains_on_sigterm(tiny_standins: Path, tmp_path: Path) -> None:
    """`rewardstack serve` with 256 open files: 400 connections sending headers a byte at a time do
    not stop a real client, the log stays a few lines, and SIGTERM with a client mid-body ends the
    process (exit 0) within the drain bound."""
    config = write_config(tiny_standins, tmp_path / "state", "slow", header_timeout_s=2.0, body_timeout_s=60.0,
                          drain_timeout_s=3.0)
    server = Server(config, log=tmp_path / "server.log")
    server._log = open(server.log, "ab")  # started here rather than by Server.start: under the limit
    server.proc = subprocess.Popen([sys.executable, "-m", "rewardstack.cli", "serve", "--config", str(config),
                                    "--port", str(server.port)], stdout=server._log, stderr=subprocess.STDOUT,
                                   env=server.env, preexec_fn=_fd_limit(256))
    server.wait_ready()
    port = server.port
    try:
        slow: list[socket.socket] = []
        for _ in range(400):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                slow.append(s)
            except OSError:
                pass
        t0 = time.monotonic()
        answered = None
        while time.monotonic() - t0 < 30:
            try:
                answered = httpx.post(server.url + "/v1/score", timeout=30, json={
                    "name": "augment", "prompt": "held?", "completions": ["not held", "still answered"]})
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert answered is not None and answered.status_code == 200, answered
        for s in slow:
            s.close()
        # A client mid-body at one byte a second when SIGTERM comes.
        body = b'{"name": "augment", "prompt": "p", "completions": ["x"]}'
        mid = socket.create_connection(("127.0.0.1", port), timeout=5)
        mid.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body))
        stop = threading.Event()

        def trickle() -> None:
            for b in body:
                if stop.wait(1.0):
                    return
                try:
                    mid.sendall(bytes([b]))
                except OSError:
                    return

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        code = server.terminate(timeout=60)
        took = time.monotonic() - t0
        stop.set()
        mid.close()
    finally:
        server.stop()
    log_lines = (tmp_path / "server.log").read_text(errors="replace").splitlines()
    assert code == 0 and took < 3.0 + 10.0, (code, took, log_lines[-20:])
    after_ready = log_lines[next(i for i, x in enumerate(log_lines) if "worker ready" in x):]
    assert len(after_ready) < 15 and not any("Traceback" in x for x in after_ready), after_ready
