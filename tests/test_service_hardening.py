"""The scoring service against clients that probe it (issue 33), in process on the fake scorers.

Each test builds the FastAPI app over a started worker and talks to it through httpx's ASGI
transport, so what is checked is the app's own answer: which namespace names a caller may see,
what a browser on the same machine can make it do, how a client that goes away is counted, and
the error shape of routes that do not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from rewardstack._service.app import create_app  # noqa: E402
from rewardstack._service.access import Access  # noqa: E402
from rewardstack._service.worker import Worker  # noqa: E402

ADMIN = "admin-token-for-hardening"
ALPHA = "alpha-token-for-hardening"
LOCAL = "http://127.0.0.1:8000"


def _step(tag: str, **extra: object) -> dict:
    return {"name": "augment", "prompt": f"prompt {tag}", "completions": [f"{tag} one", f"{tag} two"], **extra}


@pytest.fixture
def make_service(fake_config) -> Iterator[Callable[..., Any]]:  # noqa: ANN001
    """Builds (app, worker) with the given access and [service] settings; drains every worker after."""
    workers: list[Worker] = []

    def make(access: Access | None = None, **settings: Any) -> tuple[Any, Worker]:
        s = fake_config.service
        for key, value in settings.items():
            setattr(s, key, value)
        worker = Worker(fake_config, queue_size=s.queue_size, batch_requests=s.batch_requests,
                        max_namespaces=s.max_namespaces)
        workers.append(worker)
        worker.start()
        end = time.monotonic() + 60
        while not worker.ready and time.monotonic() < end:
            time.sleep(0.02)
        assert worker.ready, worker.error
        return create_app(fake_config, s, access or Access({}), worker=worker), worker

    yield make
    for w in workers:
        w.begin_drain()
        w.join(30)


def client(app: Any, base_url: str = LOCAL, token: str | None = None, **kw: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer here
    return httpx.AsyncClient(transport=transport, base_url=base_url, headers=headers, **kw)


def tokens() -> Access:
    return Access({hashlib.sha256(ADMIN.encode()).hexdigest(): "*", hashlib.sha256(ALPHA.encode()).hexdigest(): "alpha"})


# -- 7. namespace names only to callers allowed to see them -----------------------------------------

def test_healthz_names_no_namespace_while_scoring(make_service) -> None:  # noqa: ANN001
    app, worker = make_service(tokens())
    inside, release = threading.Event(), threading.Event()
    forward_many = worker.stack.forward_many

    def slow(steps):  # noqa: ANN001, ANN202 - holds the worker inside the forward pass
        inside.set()
        release.wait(30)
        return forward_many(steps)

    worker.stack.forward_many = slow

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with client(app, token=ADMIN) as c, client(app) as anonymous:
            post = asyncio.ensure_future(c.post("/v1/score", json=_step("h", namespace="hotkey5Secret")))
            await asyncio.to_thread(inside.wait, 30)
            health = await anonymous.get("/healthz")
            release.set()
            return health, await post

    health, scored = asyncio.run(run())
    assert scored.status_code == 200, scored.text
    assert health.status_code == 200 and health.json()["running"].startswith("forward pass")
    assert "hotkey5Secret" not in health.text, health.text


def test_a_namespace_bound_token_sees_only_its_own_namespace(make_service) -> None:  # noqa: ANN001
    app, _ = make_service(tokens())

    async def run() -> tuple[dict, dict]:
        async with client(app, token=ADMIN) as admin, client(app, token=ALPHA) as alpha:
            for ns in ("alpha", "beta", "gamma"):
                assert (await admin.post("/v1/score", json=_step(ns, namespace=ns))).status_code == 200
            return (await alpha.get("/v1/stack")).json(), (await admin.get("/v1/stack")).json()

    seen_by_alpha, seen_by_admin = asyncio.run(run())
    assert seen_by_alpha["namespaces"] == ["alpha"]
    assert "beta" not in json.dumps(seen_by_alpha)
    assert seen_by_admin["namespaces"] == ["alpha", "beta", "gamma"]


# -- 10. the minor items ------------------------------------------------------------------------------

def test_unknown_routes_and_methods_answer_the_documented_error_shape(make_service) -> None:  # noqa: ANN001
    app, _ = make_service()

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with client(app) as c:
            return await c.get("/v1/nothing-here"), await c.get("/v1/score")

    missing, wrong_method = asyncio.run(run())
    assert missing.status_code == 404 and missing.json() == {
        "error": {"message": "no route GET /v1/nothing-here", "type": "not_found", "field": None}}
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "method_not_allowed"
    assert wrong_method.headers["allow"] == "POST"


def test_duplicate_keys_are_refused_with_a_clear_error(make_service) -> None:  # noqa: ANN001
    from rewardstack.errors import InputError
    from rewardstack._fileio import parse

    with pytest.raises(InputError, match='duplicate key "prompt"'):
        parse('{"name": "augment", "prompt": "a", "completions": [], "prompt": "b"}')
    app, _ = make_service()
    body = b'{"name": "augment", "prompt": "first", "prompt": "second", "completions": ["x y"]}'

    async def run() -> httpx.Response:
        async with client(app) as c:
            return await c.post("/v1/score", content=body, headers={"content-type": "application/json"})

    r = asyncio.run(run())
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json", r.text
    assert 'duplicate key "prompt"' in r.json()["error"]["message"]


def test_a_json_error_says_at_column_once() -> None:
    from rewardstack.errors import InputError
    from rewardstack._fileio import parse

    with pytest.raises(InputError) as e:
        parse('{"prompt": "a\x01b"}')
    assert "at at" not in str(e.value) and "Invalid control character at column 14" in str(e.value), str(e.value)


# -- 4. loopback writes only from clients that mean it ------------------------------------------------

def test_on_loopback_without_a_token_a_browsers_cross_origin_write_is_refused(make_service) -> None:  # noqa: ANN001
    """Issue 33 #4: a text/plain POST with a foreign Host and Origin (a page in a browser on the
    same machine, or DNS rebinding) was scored and applied."""
    app, _ = make_service(host="127.0.0.1", port=8000)
    body = json.dumps(_step("csrf", namespace="func")).encode()

    async def run() -> dict[str, httpx.Response]:
        async with client(app) as c, client(app, base_url="http://rebound.example:8000") as rebound:
            out = {
                "text/plain": await c.post("/v1/score", content=body, headers={"content-type": "text/plain"}),
                "no type": await c.post("/v1/score", content=body),
                "form": await c.post("/v1/score", content=body,
                                     headers={"content-type": "application/x-www-form-urlencoded"}),
                "rebound host": await rebound.post("/v1/score", content=body, headers={"content-type": "application/json"}),
                "rebound read": await rebound.get("/v1/stack"),
                "foreign origin": await c.post("/v1/score", content=body, headers={
                    "content-type": "application/json", "origin": "http://evil.example"}),
            }
            out["sequence"] = await c.get("/v1/namespaces/func")
            out["ok"] = await c.post("/v1/score", content=body, headers={"content-type": "application/json; charset=utf-8"})
            async with client(app, base_url="http://localhost:9000") as tunnel:  # an SSH tunnel's port
                out["tunnel"] = await tunnel.post("/v1/score", json=_step("t", namespace="func"),
                                                  headers={"origin": "http://localhost:9000"})
            return out

    out = asyncio.run(run())
    for key in ("text/plain", "no type", "form"):
        assert out[key].status_code == 415 and out[key].json()["error"]["type"] == "unsupported_media_type", key
    for key in ("rebound host", "rebound read"):
        assert out[key].status_code == 403 and out[key].json()["error"]["field"] == "host", (key, out[key].text)
    assert out["foreign origin"].status_code == 403 and out["foreign origin"].json()["error"]["field"] == "origin"
    assert out["sequence"].json()["sequence"] == 0  # nothing above was applied
    assert out["ok"].status_code == 200 and out["tunnel"].status_code == 200, (out["ok"].text, out["tunnel"].text)


def test_with_a_token_any_host_name_may_reach_the_service(make_service) -> None:  # noqa: ANN001
    app, _ = make_service(tokens(), host="0.0.0.0")

    async def run() -> httpx.Response:
        async with client(app, base_url="http://scorer.internal:8000", token=ADMIN) as c:
            return await c.post("/v1/score", json=_step("remote"))

    assert asyncio.run(run()).status_code == 200


# -- 5. a client that goes away mid-body --------------------------------------------------------------

def _count(metrics_text: str, code: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("rewardstack_service_requests_total{") and f'code="{code}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_disconnect_mid_body_is_a_client_error_in_one_line(make_service, caplog) -> None:  # noqa: ANN001
    """Issue 33 #5: counted as code="500", with two tracebacks per disconnect."""
    app, _ = make_service()
    body = json.dumps(_step("gone")).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/score", "raw_path": b"/v1/score", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> tuple[str, BaseException | None, str]:
        async with client(app) as c:
            before = (await c.get("/metrics")).text
            raised = None
            try:
                await app(scope, receive, send)
            except Exception as e:  # noqa: BLE001 - today's behaviour: the server re-raises it
                raised = e
            return before, raised, (await c.get("/metrics")).text

    with caplog.at_level("INFO"):
        before, raised, after = asyncio.run(run())
    assert raised is None, repr(raised)
    assert _count(after, "500") == _count(before, "500")
    assert _count(after, "499") == _count(before, "499") + 1
    said = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("rewardstack", "uvicorn"))]
    assert len(said) == 1 and said[0].exc_info is None and "went away" in said[0].getMessage(), \
        [(r.name, r.getMessage()) for r in said]


# -- 2. a per-request work cap, and fairness between namespaces ----------------------------------------

def _slow_forward(worker: Worker, seconds_per_char: float) -> list[list[str]]:
    """Make the worker's forward pass take time in proportion to the characters it reads; returns
    the log of each turn's prompts."""
    forward_many = worker.stack.forward_many
    turns: list[list[str]] = []

    def slow(steps):  # noqa: ANN001, ANN202
        chars = sum(len(s.prompt) * len(s.completions) + sum(len(c or "") for c in s.completions) for s in steps)
        turns.append([s.prompt[:12] for s in steps])
        time.sleep(chars * seconds_per_char)
        return forward_many(steps)

    worker.stack.forward_many = slow
    return turns


def _big(tag: str) -> dict:
    return {"name": "augment", "prompt": f"big {tag} " + "p" * 10_000, "completions": [f"{tag} {j} " + "c" * 2000 for j in range(8)]}


def test_a_request_past_the_work_cap_is_413_before_any_model_runs(make_service) -> None:  # noqa: ANN001
    app, worker = make_service(max_work_chars=100_000, max_chars=65536, max_completions=256)
    turns = _slow_forward(worker, 0.0)
    too_much = {"name": "augment", "prompt": "p" * 20_000, "completions": ["c"] * 16}  # 16 x 20,001 > 100,000

    async def run() -> httpx.Response:
        async with client(app) as c:
            return await c.post("/v1/score", json={**too_much, "namespace": "heavy"})

    r = asyncio.run(run())
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_much_work", (r.status_code, r.text[:300])
    assert r.json()["error"]["field"] == "completions" and "max_work_chars" in r.json()["error"]["message"]
    assert turns == []  # refused before any tokenization or forward pass


def test_one_namespaces_largest_requests_do_not_hold_back_anothers_small_one(make_service) -> None:  # noqa: ANN001
    """Issue 33 #2: another namespace's small request waited behind every large request queued
    before it (one turn took them all, first come first served)."""
    app, worker = make_service(max_work_chars=100_000, max_chars=65536, max_completions=256, batch_requests=16,
                               deadline_s=60.0)
    per_big = 0.8
    turns = _slow_forward(worker, per_big / 96_000)  # one large request: 0.8 s

    async def run() -> tuple[float, list[httpx.Response], httpx.Response]:
        async with client(app, timeout=60) as c:
            bigs = [asyncio.ensure_future(c.post("/v1/score", json={**_big(str(k)), "namespace": "large"}))
                    for k in range(4)]
            await asyncio.sleep(0.3)  # the first large one is running, three wait
            t0 = time.monotonic()
            small = await c.post("/v1/score", json=_step("small", namespace="small"))
            took = time.monotonic() - t0
            return took, list(await asyncio.gather(*bigs)), small

    took, bigs, small = asyncio.run(run())
    assert small.status_code == 200 and [b.status_code for b in bigs] == [200] * 4
    # It waits for the large request that is running, then goes first: not behind the other three.
    assert took < per_big + 0.6, (took, turns)
    assert sorted(b.json()["sequence"] for b in bigs) == [1, 2, 3, 4]  # each applied once
