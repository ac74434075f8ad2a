"""The scoring service over real HTTP: one `rewardstack serve` subprocess on loopback for the module.

Per-namespace results equal scoring the steps one by one in a fresh state; retries are answered
from the store; gaps are 409; limits are 413 and 429; tokens are required and bound; the
openvalidators drop-in gives the stack's rewards.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from rewardstack._fileio import event_line  # noqa: E402
from rewardstack.client import Client  # noqa: E402
from rewardstack.config import load_config  # noqa: E402
from rewardstack.stack import RewardStack  # noqa: E402

from service_fixtures import Server, comparable, text_steps, write_config  # noqa: E402

ADMIN = "admin-token-for-tests"
ALPHA = "alpha-token-for-tests"
LIMITS = {"max_completions": 8, "max_chars": 2000, "max_body_bytes": 65536, "queue_size": 2, "batch_requests": 4}


@pytest.fixture(scope="module")
def server(standins: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tmp = tmp_path_factory.mktemp("service_api")
    tokens = tmp / "tokens.toml"
    tokens.write_text(f'"{hashlib.sha256(ALPHA.encode()).hexdigest()}" = "alpha"\n')
    config = write_config(standins, tmp / "state", "api", tokens_file=str(tokens), **LIMITS)
    srv = Server(config, env={"REWARDSTACK_TOKEN": ADMIN}, log=tmp / "server.log").start()
    try:
        yield srv.wait_ready()
    finally:
        assert srv.terminate() == 0, (tmp / "server.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def reference(server: Server) -> RewardStack:
    """The same stack in this process (no state loaded or saved): the reference the service must match."""
    return RewardStack(load_config(server.config), load_state=False)


def one_by_one(stack: RewardStack, steps: list[dict]) -> list[dict]:
    """Each step scored in order against a fresh state, as `rewardstack score` would write them."""
    state = stack.new_state()
    return [json.loads(event_line(state.apply(stack.forward(s)).event)) for s in steps]


def http(server: Server, token: str | None = ADMIN) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {token}"} if token else {})


def test_two_namespaces_concurrently_get_what_one_by_one_scoring_gives(server: Server, reference: RewardStack) -> None:
    steps = {"alpha": text_steps("a", 7), "beta": text_steps("b", 7)}
    for s in steps["beta"]:  # the stock phrase only in one namespace: no embedding shared across them
        s["completions"] = [c if c != "That is an excellent question." else c + " b" for c in s["completions"]]
    got: dict[str, list[dict]] = {}
    errors: list[BaseException] = []

    def run(ns: str) -> None:
        try:
            with Client(server.url, namespace=ns, token=ADMIN) as c:
                got[ns] = [c.score(s) for s in steps[ns]]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(ns,)) for ns in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for ns, events in got.items():
        assert [e["sequence"] for e in events] == list(range(1, len(steps[ns]) + 1))
        want = one_by_one(reference, steps[ns])
        assert [comparable(e) for e in events] == [comparable(w) for w in want], ns
    # The blacklist really worked per namespace: the stock phrase is masked in alpha.
    assert got["alpha"][1]["blacklist_filter"][2] == 0.0


def test_retry_returns_the_stored_result_and_a_gap_is_409(server: Server, reference: RewardStack) -> None:
    steps = text_steps("r", 3)
    with http(server) as h:
        first = h.post("/v1/score", json={**steps[0], "namespace": "retry", "sequence": 1})
        assert first.status_code == 200 and first.headers["x-rewardstack-scored"] == "true"
        again = h.post("/v1/score", json={**steps[0], "namespace": "retry", "sequence": 1})
        assert again.status_code == 200 and again.headers["x-rewardstack-scored"] == "false"
        assert again.content == first.content  # the stored answer, step_length and all
        assert h.get("/v1/namespaces/retry").json()["sequence"] == 1
        # Two copies of one request racing: one is scored, both get its answer.
        out: list[httpx.Response] = []
        body = {**steps[1], "namespace": "retry", "sequence": 2}
        ts = [threading.Thread(target=lambda: out.append(h.post("/v1/score", json=body))) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert [r.status_code for r in out] == [200, 200] and out[0].content == out[1].content
        other = h.post("/v1/score", json={**steps[2], "namespace": "retry", "sequence": 1})
        assert other.status_code == 409 and other.json()["error"]["type"] == "sequence_conflict"
        gap = h.post("/v1/score", json={**steps[2], "namespace": "retry", "sequence": 5})
        assert gap.status_code == 409
        err = gap.json()["error"]
        assert err["type"] == "sequence_gap" and err["field"] == "sequence" and "expects sequence 3" in err["message"]
        third = h.post("/v1/score", json={**steps[2], "namespace": "retry", "sequence": 3})
    # The state is as if each step had been sent once.
    want = one_by_one(reference, steps)
    assert comparable(third.json()) == comparable(want[2])
    assert comparable(json.loads(first.content)) == comparable(want[0])


def test_errors_name_the_field(server: Server) -> None:
    with http(server) as h:
        r = h.post("/v1/score", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json"
        cases = [
            ({"name": "augment", "completions": ["x"]}, "prompt"),
            ({"name": "augment", "prompt": "p", "completions": ["x"], "uids": [1, 2]}, "uids"),
            ({"name": "augment", "prompt": "p", "completions": ["x"], "namespace": "../etc"}, "namespace"),
            ({"name": "augment", "prompt": "p", "completions": ["x"], "sequence": "1"}, "sequence"),
            ({"name": "augment", "prompt": "p", "completions": ["x"], "sequence": 0}, "sequence"),
        ]
        for body, field in cases:
            r = h.post("/v1/score", json=body)
            assert r.status_code == 422, (body, r.text)
            err = r.json()["error"]
            assert err["field"] == field and field in err["message"], err


def test_limits_are_413_before_scoring(server: Server) -> None:
    ok = {"name": "augment", "prompt": "p", "namespace": "limits"}
    with http(server) as h:
        r = h.post("/v1/score", json={**ok, "completions": ["c"] * 9})
        assert r.status_code == 413 and r.json()["error"]["field"] == "completions"
        r = h.post("/v1/score", json={**ok, "completions": ["short", "x" * 2001]})
        assert r.status_code == 413 and r.json()["error"]["field"] == "completions[1]"
        big = json.dumps({**ok, "completions": ["y" * 1000] * 80}).encode()  # > 64 KiB
        r = h.post("/v1/score", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"

        def chunks():  # no Content-Length: counted as the bytes arrive
            for i in range(0, len(big), 4096):
                yield big[i:i + 4096]

        r = h.post("/v1/score", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"
        assert h.get("/v1/namespaces/limits").json()["sequence"] == 0  # nothing was scored


def test_a_full_queue_is_429_with_retry_after_and_nothing_is_lost(server: Server) -> None:
    steps = text_steps("q", 12, width=8)
    codes: list[httpx.Response] = []
    lock = threading.Lock()

    def send(step: dict) -> None:
        with http(server) as h:
            r = h.post("/v1/score", json={**step, "namespace": "flood"})
        with lock:
            codes.append(r)

    ts = [threading.Thread(target=send, args=(s,)) for s in steps]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    full = [r for r in codes if r.status_code == 429]
    assert full, [r.status_code for r in codes]
    assert all(r.json()["error"]["type"] == "queue_full" and int(r.headers["retry-after"]) >= 1 for r in full)
    assert {r.status_code for r in codes} <= {200, 429}
    scored = sorted(r.json()["sequence"] for r in codes if r.status_code == 200)
    with http(server) as h:
        assert h.get("/v1/namespaces/flood").json()["sequence"] == len(scored)
    assert scored == list(range(1, len(scored) + 1))  # each applied once, none skipped


def test_tokens_are_required_and_bound_to_their_namespace(server: Server) -> None:
    step = {"name": "augment", "prompt": "p", "completions": ["an answer", "another answer"]}
    with http(server, token=None) as h:
        r = h.post("/v1/score", json=step)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "unauthorized"
        assert h.get("/metrics").status_code == 401 and h.get("/v1/stack").status_code == 401
        assert h.get("/healthz").status_code == 200 and h.get("/readyz").status_code == 200
    with http(server, token="wrong") as h:
        assert h.post("/v1/score", json=step).status_code == 401
    with http(server, token=ALPHA) as h:
        r = h.post("/v1/score", json={**step, "namespace": "beta"})
        assert r.status_code == 403 and r.json()["error"]["field"] == "namespace"
        r = h.post("/v1/score", json=step)  # no namespace: the token's own
        assert r.status_code == 200
        assert h.get("/v1/namespaces/alpha").json()["sequence"] == r.json()["sequence"]


def test_health_stack_metrics_and_openapi(server: Server) -> None:
    with http(server) as h:
        health = h.get("/healthz").json()
        assert health["status"] == "ok" and health["last_forward_at"] is not None and health["ready"] is True
        assert h.get("/readyz").json() == {"status": "ready"}
        info = h.get("/v1/stack").json()
        names = {m["name"]: m for m in info["models"]}
        assert names["rlhf_reward_model"]["weight"] == 1.0 and names["rlhf_reward_model"]["device"] == "cpu"
        assert "diversity_reward_model" in names and "relevance_filter" not in names
        assert info["queue"]["size"] == 2 and "rlhf_reward_model" in info["cost_models"]
        assert "budget" in info and "placement" in info
        metrics = h.get("/metrics")
        assert metrics.status_code == 200 and "rewardstack_service_requests_total" in metrics.text
        spec = h.get("/openapi.json").json()
        body = spec["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"name", "prompt", "completions", "namespace", "sequence"} <= set(body["properties"])
        assert {"/healthz", "/readyz", "/v1/stack", "/metrics"} <= set(spec["paths"])


def test_openvalidators_dropin_through_the_service_gives_the_stacks_rewards(server: Server, reference: RewardStack) -> None:
    from test_service_openvalidators import close, drive_validator, expected_rewards

    from rewardstack.integrations.openvalidators import OpenValidatorsStack

    with Client(server.url, namespace="validator", token=ADMIN) as c:
        got, steps = drive_validator(OpenValidatorsStack.remote(c), tag="ov-remote")
    want = expected_rewards(reference, steps)
    assert close(got, want), (got, want)


def test_binding_beyond_loopback_needs_a_token(server: Server) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "REWARDSTACK_TOKEN"}
    config = server.config.with_name("service-open.toml")
    config.write_text(server.config.read_text().replace("tokens_file", "# tokens_file"))
    for command in (["serve"], ["ray-serve", "--state-dir", str(config.parent / "ray-state")]):  # refused before Ray starts
        r = subprocess.run([sys.executable, "-m", "rewardstack.cli", *command, "--config", str(config), "--host", "0.0.0.0"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and "requires a bearer token" in r.stderr, (command, r.stderr)


def _count(metrics_text: str, code: str) -> float:
    """`rewardstack_service_requests_total{code=CODE}` in a Prometheus exposition (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("rewardstack_service_requests_total{") and f'code="{code}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_the_status_sent(server: Server) -> None:
    with http(server) as h:
        before = h.get("/metrics").text
        for bad in ({"name": "augment", "prompt": "p"}, {"name": "augment", "prompt": 3, "completions": ["x"]},
                    {"name": "augment", "prompt": "p", "completions": "not a list"}):
            assert h.post("/v1/score", json=bad).status_code == 422
        after = h.get("/metrics").text
    assert _count(after, "422") - _count(before, "422") == 3
    assert _count(after, "500") == _count(before, "500")
