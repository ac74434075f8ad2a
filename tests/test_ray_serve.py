"""The scoring service on Ray Serve (2 replicas, a local 2-CPU Ray shared with test_ray_rescore.py:
tests/ray_fixtures.py) against `rewardstack serve`, both on the tiny stand-in stack.

The reference is the service app itself (`rewardstack._service.app.create_app`, in process through
Starlette's TestClient) with its own state folder. Every response of the Ray deployment must equal
the service's for the same requests (`step_length`, a wall time, aside), per namespace and in
order, and still after a replica is killed mid-run (the clients retry with the same sequence).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from ray_fixtures import cluster_stops_after, shared_cluster, standins_config
from rewardstack._settings import ServiceSettings
from tests.soak.synthetic import heavy_tailed_steps

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SAMPLE = Path(__file__).resolve().parents[1] / "src/rewardstack/data/sample_steps.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps(n: int, seed: int) -> list[dict]:
    """Short steps: the packaged sample run first (augment, followup, answer), then workload steps."""
    out = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    for s in heavy_tailed_steps(n, 3, seed=seed, long_chars=0, prompt_chars=100):
        d = s.to_dict()
        d["completions"] = [c[:120] for c in d["completions"]]
        out.append(d)
    return out[:n]


def comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "step_length"}


def same(got: object, ref: object) -> bool:
    """Equal, floats within 1e-5: replicas and the test process run torch on different thread counts."""
    if isinstance(ref, dict):
        return isinstance(got, dict) and got.keys() == ref.keys() and all(same(got[k], ref[k]) for k in ref)
    if isinstance(ref, list):
        return isinstance(got, list) and len(got) == len(ref) and all(same(g, r) for g, r in zip(got, ref))
    if isinstance(ref, float) and isinstance(got, float):
        return got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    return got == ref


@pytest.fixture(scope="module")
def cluster(request):  # noqa: ANN001, ANN201
    yield from shared_cluster(request)


@pytest.fixture(scope="module")
def urls(request, cluster, tiny_standins, tmp_path_factory):  # noqa: ANN001, ANN201
    from fastapi.testclient import TestClient

    from rewardstack._distributed.serve import APP_NAME, build_app, stop_namespace_actors
    from rewardstack._service.app import create_app
    from rewardstack._service.access import Access

    root = tmp_path_factory.mktemp("serve")
    settings = ServiceSettings(max_completions=8, queue_size=8)
    config = standins_config(tiny_standins, root / "ray-state")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(config, settings, {}, state_dir=str(root / "ray-state"), replicas=2, cpus_per_replica=0.5,
                    reorder_wait_s=1.0)
    # The replicas load in the cluster while the reference service loads here.
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    reference = create_app(standins_config(tiny_standins, root / "service-state"), settings, Access({}))
    with TestClient(reference, base_url="http://127.0.0.1") as service:  # loopback without a token: a local Host
        deadline = time.monotonic() + 600
        while service.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the reference service did not get ready"
            time.sleep(0.2)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as ray_client:
            while True:
                try:
                    if ray_client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the Serve deployment did not get ready"
                time.sleep(0.5)
            yield service, ray_client
    stop_namespace_actors(root / "ray-state")
    if not cluster_stops_after(request):
        # Ray goes on for another file: the application and Serve are stopped gracefully. Otherwise
        # Ray's shutdown right after ends them with the rest, without waiting up to Serve's 20 s
        # for the replica started in place of the killed one to finish loading and then drain.
        serve.delete(APP_NAME)
        serve.shutdown()


RETRIED: list[tuple[str, int, str]] = []
"""(namespace, sequence, why) of every retried request."""


def post(client, body: dict, retry: bool = False) -> tuple[int, dict, dict]:  # noqa: ANN001
    """One request; with `retry`, a failure of the transport or a 5xx is retried with the same body."""
    for attempt in range(600):  # a replacement replica loads its stack: up to minutes on a busy machine
        try:
            r = client.post("/v1/score", content=json.dumps(body), headers={"content-type": "application/json"})
        except httpx.TransportError as e:
            if not retry:
                raise
            RETRIED.append((body.get("namespace"), body.get("sequence"), type(e).__name__))
            time.sleep(0.5)
            continue
        if retry and r.status_code >= 500:
            RETRIED.append((body.get("namespace"), body.get("sequence"), str(r.status_code)))
            time.sleep(0.5)
            continue
        return r.status_code, r.json(), dict(r.headers)
    raise AssertionError(f"no answer after retries for {body.get('namespace')} #{body.get('sequence')}")


def test_two_namespaces_answer_as_the_service_does_in_order(urls) -> None:  # noqa: ANN001
    service, ray_client = urls
    per_ns = {"alice": steps(4, seed=1), "bob": steps(4, seed=2)[::-1]}
    for i in range(4):  # interleaved: alice 1, bob 1, alice 2, ...
        for ns, ss in per_ns.items():
            body = ss[i] | {"namespace": ns, "sequence": i + 1}
            code_ref, ref, _ = post(service, body)
            code, got, _ = post(ray_client, body)
            assert (code_ref, code) == (200, 200), (ref, got)
            assert same(comparable(got), comparable(ref)), (ns, i, got, ref)
            assert got["sequence"] == i + 1
    # A retry of a committed step gets the stored result, scored once.
    body = per_ns["alice"][1] | {"namespace": "alice", "sequence": 2}
    code, got, headers = post(ray_client, body)
    _, ref, ref_headers = post(service, body)
    assert code == 200 and same(comparable(got), comparable(ref))
    assert headers["x-rewardstack-scored"] == ref_headers["x-rewardstack-scored"] == "false"
    # The same refusals, with the same bodies: a gap, too many completions, a bad field.
    refusals = [
        per_ns["alice"][0] | {"namespace": "alice", "sequence": 7},
        {"name": "augment", "prompt": "p", "completions": ["x"] * 9, "namespace": "alice"},
        {"name": "augment", "prompt": "p", "completions": "x", "namespace": "bob"},
        {"name": "augment", "prompt": "p", "completions": ["x"], "namespace": "no/slash"},
    ]
    for body in refusals:
        code_ref, ref, _ = post(service, body)
        code, got, _ = post(ray_client, body)
        assert (code, got) == (code_ref, ref)
    assert [r["error"]["type"] for r in [post(ray_client, b)[1] for b in refusals]] == [
        "sequence_gap", "too_many_completions", "invalid_step", "invalid_step"]
    # The service's guards and conflict rule, the same answers: another step reusing a committed
    # sequence number (409), a body not sent as JSON (415), a foreign Host on loopback (403).
    conflict = json.dumps(per_ns["bob"][0] | {"namespace": "alice", "sequence": 1})
    unguarded = [({"content-type": "application/json"}, "sequence_conflict"),
                 ({"content-type": "text/plain"}, "unsupported_media_type"),
                 ({"content-type": "application/json", "host": "rebound.example"}, "forbidden_host")]
    for headers, kind in unguarded:
        r_ref = service.post("/v1/score", content=conflict, headers=headers)
        r = ray_client.post("/v1/score", content=conflict, headers=headers)
        assert (r.status_code, r.json()) == (r_ref.status_code, r_ref.json())
        assert r.json()["error"]["type"] == kind, r.json()
    assert ray_client.get("/v1/namespaces/alice").json() == service.get("/v1/namespaces/alice").json()


def test_a_second_writer_is_fenced_as_the_service_fences_it(urls) -> None:  # noqa: ANN001
    service, ray_client = urls
    ss = steps(3, seed=3)
    answers = []
    for http in (service, ray_client):
        def session(name: str) -> dict:
            r = http.post("/v1/namespaces/erin/sessions", json={"client": name, "host": "h", "pid": 1})
            assert r.status_code == 200, r.text
            return r.json()

        first = session("first-writer")
        assert post(http, ss[0] | {"namespace": "erin", "sequence": 1, "epoch": first["epoch"]})[0] == 200
        second = session("second-writer")  # fences the first
        assert second["next"] == 2 and second["previous"]["client"] == "first-writer"
        code, stale, _ = post(http, ss[1] | {"namespace": "erin", "sequence": 2, "epoch": first["epoch"]})
        assert code == 409 and stale["error"]["type"] == "fenced" and "second-writer" in stale["error"]["message"]
        code, unknown, _ = post(http, ss[1] | {"namespace": "erin", "sequence": 2, "epoch": second["epoch"] + 1})
        assert code == 409 and unknown["error"]["type"] == "session_unknown"
        assert post(http, ss[2] | {"namespace": "erin", "sequence": 2, "epoch": second["epoch"]})[0] == 200
        answers.append(http.get("/v1/namespaces/erin").json())
    assert [a["holder"]["client"] for a in answers] == ["second-writer"] * 2
    assert [a["next"] for a in answers] == [3, 3]


def test_a_replica_killed_mid_run_loses_nothing(urls) -> None:  # noqa: ANN001
    service, ray_client = urls
    # The clients keep stepping until a replica has been caught scoring and killed, then two more
    # steps each: on a fast machine six steps ended before /healthz saw one in flight.
    cap = 40
    per_ns = {"carol": steps(cap, seed=3), "dave": steps(cap, seed=4)}
    got: dict[str, list[dict]] = {ns: [] for ns in per_ns}
    errors: list[BaseException] = []
    killed_event = threading.Event()

    def client(ns: str) -> None:
        try:
            with httpx.Client(base_url=str(ray_client.base_url), timeout=120) as c:
                after = 0
                for i, step in enumerate(per_ns[ns]):
                    code, body, _ = post(c, step | {"namespace": ns, "sequence": i + 1}, retry=True)
                    assert code == 200, body
                    got[ns].append(body)
                    after += killed_event.is_set()
                    if after >= 2:
                        break
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(ns,)) for ns in per_ns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while min(len(v) for v in got.values()) < 2 and not errors:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Kill a replica while it is scoring a request (its /healthz says so). However that request
    # ends (an error the client retries with the same sequence, or a retry inside Serve), the
    # namespace's state actor applies each sequence number once.
    killed = None
    while killed is None and any(t.is_alive() for t in threads):
        health = ray_client.get("/healthz").json()
        if health["in_flight"] >= 1:
            os.kill(health["replica"]["pid"], signal.SIGKILL)  # the replica dies mid-request
            killed = health
            killed_event.set()
        time.sleep(0.01)
    assert killed is not None, "no replica was caught scoring"
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for ns, ss in per_ns.items():
        n = len(got[ns])
        assert 2 <= n < cap, (ns, n)
        for i, step in enumerate(ss[:n]):
            code, ref, _ = post(service, step | {"namespace": ns, "sequence": i + 1})
            assert code == 200
            assert same(comparable(got[ns][i]), comparable(ref)), (ns, i)
        assert ray_client.get(f"/v1/namespaces/{ns}").json()["sequence"] == n  # each step applied once
