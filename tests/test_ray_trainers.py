"""The trainer routes on Ray Serve (2 replicas on the local 2-CPU Ray the Ray files share:
tests/ray_fixtures.py), driven by OpenRLHF's and verl's own request code (tests/trainer_clients.py).

The application serves the tiny Llama reward model of tests/trainer_fixtures.py from the one-line
start's flags (`config.build_config`, as `rewardstack ray-serve --reward-model DIR` builds it);
the reference is that model's own transformers forward, and `rewardstack serve`'s app (in process)
on the same model from a TOML `[rewards.tiny]` table. Checked: the answers of both trainers' code
equal both within 1e-5; a burst of 4,096 one-sample requests from one process (OpenRLHF's
`_fetch_rewards_via_http`, one URL per request) is answered whole with no request refused or
resent; a replica killed mid-burst costs the requests it held a resend, never a reward.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from ray_fixtures import cluster_stops_after, shared_cluster
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOL = 1e-5
BURST = 4096


@pytest.fixture(scope="module")
def cluster(request):  # noqa: ANN001, ANN201
    yield from shared_cluster(request)


@pytest.fixture(scope="module")
def served(request, cluster, tmp_path_factory):  # noqa: ANN001, ANN201
    """(Serve URL, one-process service client, model folder)."""
    from fastapi.testclient import TestClient

    from rewardstack.config import build_config, load_config
    from rewardstack._distributed.serve import APP_NAME, build_app
    from rewardstack._service.app import create_app
    from rewardstack._service.access import Access

    root = tmp_path_factory.mktemp("ray-trainers")
    model = make_tiny_llama_rm(root / "tiny-rm")
    config = build_config(None, [str(model)], device="cpu", max_length=64, truncation_side="left")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(config, config.service, {}, state_dir=str(root / "state"), replicas=2, cpus_per_replica=0.5)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)  # replicas load while the reference does
    toml = load_config(rewards_config(root, model, extra='max_length = 64\ntruncation_side = "left"'))
    with TestClient(create_app(toml, toml.service, Access({})), base_url="http://127.0.0.1") as service:
        deadline = time.monotonic() + 600
        while service.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the reference service did not get ready"
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        while not _ready(url):
            assert time.monotonic() < deadline, "the Serve application did not get ready"
            time.sleep(0.5)
        yield url, service, model
    if not cluster_stops_after(request):
        serve.delete(APP_NAME)
        serve.shutdown()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


class Resends(logging.Handler):
    """Counts the OpenRLHF client's failed tries (it logs each one, then sleeps a second and resends)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def resends():  # noqa: ANN201
    handler, log = Resends(), logging.getLogger("trainer_clients")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield handler.messages
    log.removeHandler(handler)
    log.setLevel(level)


def test_openrlhf_and_verl_on_serve_match_transformers_and_the_service(served: Any, resends: list[str]) -> None:
    from transformers import AutoTokenizer

    from trainer_clients import OpenRLHFExecutor, VerlRewardLoopWorker

    url, service, model = served
    queries = texts(12, seed=1)
    [answer] = asyncio.run(OpenRLHFExecutor(url + "/get_reward")._fetch_rewards_via_http(
        queries, ["p"] * len(queries), [None] * len(queries)))
    want = reference_scores(model, queries, max_length=64, side="left", add_special_tokens=False)  # serve_rm's convention
    one_process = service.post("/get_reward", json={"query": queries}).json()["rewards"]
    assert max(abs(a - b) for a, b in zip(answer["rewards"], want)) < TOL
    assert max(abs(a - b) for a, b in zip(answer["rewards"], one_process)) < TOL
    assert answer["extra_logs"]["tiny-rm"] == answer["rewards"]  # the flag's model is named for its folder
    assert 0.0 < sum(answer["extra_logs"]["truncated"]) < len(queries)  # max_length = 64, from the flags
    # OpenRLHF's default: one query per request, all at once (one URL per query).
    got = asyncio.run(OpenRLHFExecutor([url + "/get_reward"] * 4)._fetch_rewards_via_http(
        queries[:4], ["p"] * 4, [None] * 4))
    assert [g["rewards"][0] for g in got] == answer["rewards"][:4]
    # verl's reward-model path: /classify with the chat rendered by the model's template.
    tok = AutoTokenizer.from_pretrained(str(model))
    ns = types.SimpleNamespace
    config = ns(reward_model=ns(rollout=ns(name="vllm"), model=ns(path=str(model))))
    worker = VerlRewardLoopWorker(config, url.removeprefix("http://"), tok, tok)
    chat = [{"role": "user", "content": "Rate this summary question"}]
    ids = tok("a text summary it is", add_special_tokens=False)["input_ids"]
    item = ns(batch={"responses": _tensor(ids), "attention_mask": _tensor([1] * (3 + len(ids)))},
              non_tensor_batch={"raw_prompt": chat})
    data = type("Data", (), {"__len__": lambda self: 1, "__getitem__": lambda self, i: item})()
    score = asyncio.run(worker.compute_score_disrm(data))["reward_score"]
    rendered = tok.apply_chat_template(chat + [{"role": "assistant", "content": "a text summary it is"}],
                                       tokenize=False)
    # verl strips the BOS the template wrote and /classify adds it back (vLLM's convention): one BOS.
    [want_verl] = reference_scores(model, [rendered], add_special_tokens=False, max_length=64, side="left")
    sent = rendered.removeprefix(tok.bos_token)  # what verl sends
    one_process_verl = service.post("/classify", json={"model": str(model), "input": sent,
                                                       "activation": False}).json()["data"][0]["probs"][0]
    assert abs(score - want_verl) < TOL and abs(score - one_process_verl) < TOL
    assert httpx.get(url + "/health").status_code == 200  # verl and vLLM's probes
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny-rm"]
    assert resends == []


def _tensor(values: list[int]) -> Any:
    import torch

    return torch.tensor(values)


def test_a_burst_of_4096_one_sample_requests_is_answered_whole(served: Any, resends: list[str]) -> None:
    """From one process, OpenRLHF's own code: 4,096 sessions at once; none refused, none resent."""
    from trainer_clients import OpenRLHFExecutor

    url, _, model = served
    queries = texts(BURST, seed=7)
    t0 = time.monotonic()
    got = asyncio.run(OpenRLHFExecutor([url + "/get_reward"] * BURST)._fetch_rewards_via_http(
        queries, ["p"] * BURST, [None] * BURST))
    drained = time.monotonic() - t0
    # Nothing refused at the default bounds (no 429/503); on a loaded 2-core machine a try may outlast
    # OpenRLHF's own 180 s client timeout and be resent, which costs time, never a reward (below).
    assert not [r for r in resends if "Request error" in r], resends[:3]
    distinct = sorted(set(queries))
    alone = dict(zip(distinct, reference_scores(model, distinct, max_length=64, side="left", add_special_tokens=False)))
    worst = max(abs(g["rewards"][0] - alone[q]) for g, q in zip(got, queries))
    assert len(got) == BURST and worst < TOL, worst
    print(f"burst of {BURST} on Serve (2 replicas): drained in {drained:.1f}s")  # -s shows it


def test_serve_bounds_carry_the_burst_and_accept_autoscaling() -> None:
    """The replicas' Serve options (no cluster needed): a replica takes two trainer batches, never
    more than its lane holds; the proxy holds the rest, then answers 503 (verl resends no 4xx)."""
    from rewardstack._distributed.serve import MAX_QUEUED_REQUESTS, TRAINER_BATCH, ScoringReplica, deployment_options
    from rewardstack._settings import ServiceSettings

    settings = ServiceSettings()
    opts = deployment_options(settings, replicas=2)
    assert opts["max_ongoing_requests"] == 2 * TRAINER_BATCH <= settings.stateless_queue
    assert 2 * opts["max_ongoing_requests"] + MAX_QUEUED_REQUESTS >= BURST and opts["num_replicas"] == 2
    assert opts["backpressure_config"] == {"status_code": 503, "retry_after_s": 1}
    small = deployment_options(ServiceSettings(stateless_queue=10), replicas=1, max_replicas=4)
    assert small["max_ongoing_requests"] == 10 and "num_replicas" not in small
    assert small["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 10}
    serve.deployment(ScoringReplica, **small)  # Serve accepts them as they are


def test_a_replica_killed_mid_burst_costs_no_reward(served: Any, resends: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer_clients

    url, _, model = served
    n = 1024
    queries = texts(n, seed=9)
    answered = [0]
    trace = aiohttp.TraceConfig()

    async def count(session: Any, ctx: Any, params: Any) -> None:
        answered[0] += 1

    trace.on_request_end.append(count)
    # The client's code stays as it is; its sessions report each answer, so that the kill lands
    # while both replicas hold requests.
    shim = types.SimpleNamespace(ClientTimeout=aiohttp.ClientTimeout, ClientError=aiohttp.ClientError,
                                 ClientSession=functools.partial(aiohttp.ClientSession, trace_configs=[trace]))
    monkeypatch.setattr(trainer_clients, "aiohttp", shim)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ScoringReplica" in a["name"]]
    assert len(replicas) == 2, replicas

    async def burst_and_kill() -> list[dict]:
        burst = asyncio.ensure_future(trainer_clients.OpenRLHFExecutor([url + "/get_reward"] * n)
                                      ._fetch_rewards_via_http(queries, ["p"] * n, [None] * n))
        while answered[0] < n // 8 and not burst.done():
            await asyncio.sleep(0.01)
        assert not burst.done()
        victim = replicas[0]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        return await burst

    got = asyncio.run(burst_and_kill())
    # The kill landed mid-burst (asserted above) and took the replica. What it costs the client depends
    # on where the victim's requests were: those it was running come back as errors and are resent
    # (`resends`); those still queued in Serve's proxy go to the survivor unseen. On a loaded machine
    # either may happen; a lost or changed reward never may.
    with pytest.raises(ValueError):
        ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    distinct = sorted(set(queries))
    alone = dict(zip(distinct, reference_scores(model, distinct, max_length=64, side="left", add_special_tokens=False)))
    assert len(got) == n
    assert max(abs(g["rewards"][0] - alone[q]) for g, q in zip(got, queries)) < TOL
