"""The trainer routes' input handling: each trainer's tokenization convention, inputs that stand
alone, the size caps, unknown fields, empty texts, per-table tokenizer settings, the metrics, the
client's splitting and retries, and a namespace whose state file cannot be read.

`rewardstack serve` on a tiny Llama reward model whose tokenizer behaves as Llama-3's (a BOS added
by the post-processor and written by the chat template: tests/trainer_fixtures.py). OpenRLHF's own
`serve_rm.py` (tests/openrlhf_serve_rm.py, its model loader replaced) scores the same queries.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service_fixtures import Server
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts

TOL = 1e-5
SERVICE = "\n[service]\nbatch_wait_s = 0.25\n"
"""Requests that arrive within a quarter second share a batch: the concurrent tests rely on it."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_rm(tmp_path_factory.mktemp("rm") / "tiny-rm")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    config = rewards_config(tmp_path_factory.mktemp("serve"), model, extra="max_length = 64\n" + SERVICE)
    server = Server(config).start().wait_ready(300)
    try:
        yield server
    finally:
        server.stop()


def _tok(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _chats(n: int, seed: int) -> list[list[dict]]:
    out = []
    for k, t in enumerate(texts(n, seed=seed)):
        user, assistant = t.split("<|endoftext|>")[1:3]
        out.append([{"role": "user", "content": user.removeprefix("user: ") * (1 + 3 * (k % 4 == 0))},
                    {"role": "assistant", "content": assistant.removeprefix("assistant: ").rstrip("\n")}])
    return out


def _post(server: Server, path: str, body: Any) -> httpx.Response:
    """`body` as strict JSON with every non-ASCII character escaped (a lone surrogate is valid JSON)."""
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"content-type": "application/json"})


def _ok(server: Server, path: str, body: Any) -> Any:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


# -- 1. OpenRLHF's score -------------------------------------------------------------------------

def test_get_reward_gives_what_openrlhf_serve_rm_gives(server: Server, model: Path) -> None:
    from openrlhf_serve_rm import RewardModelProxy, hierarchize

    tok = _tok(model)
    # What OpenRLHF's executor sends: the chat rendered by the template, its BOS written in.
    queries = [tok.apply_chat_template(c, tokenize=False) for c in _chats(12, seed=2)]
    assert all(q.startswith(tok.bos_token) for q in queries)
    args = hierarchize(argparse.Namespace(**{
        "reward.model_name_or_path": str(model), "reward.normalize_enable": False, "ds.value_head_prefix": "score",
        "data.max_len": 64, "ds.load_in_4bit": False, "ds.param_dtype": "bf16", "ds.attn_implementation": "eager",
        "ds.experts_implementation": None, "data.disable_fast_tokenizer": False, "ds.packing_samples": False,
        "batch_size": None}))
    want = RewardModelProxy(args).get_reward(queries)
    got = _ok(server, "/get_reward", {"query": queries})
    assert max(abs(a - b) for a, b in zip(got["rewards"], want)) < TOL
    lengths = [len(ids) for ids in tok(queries, add_special_tokens=False)["input_ids"]]
    assert got["extra_logs"]["truncated"] == [float(n > 64) for n in lengths] and 0 < sum(n > 64 for n in lengths) < 12
    # The convention is the route's: the same text on /classify is tokenized as vLLM does (a BOS
    # added before the template's), unless the request says otherwise (vLLM's add_special_tokens).
    raw = lambda body: [d["probs"][0] for d in _ok(server, "/classify", {**body, "use_activation": False})["data"]]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(raw({"input": queries, "add_special_tokens": False}), want)) < TOL
    assert max(abs(a - b) for a, b in zip(raw({"messages": _chats(12, seed=2)}), want)) < TOL
    vllm = raw({"input": queries[:3]})
    assert max(abs(a - b) for a, b in zip(vllm, reference_scores(model, queries[:3], max_length=64))) < TOL
    assert max(abs(a - b) for a, b in zip(vllm, want)) > 1e-3  # two BOS tokens are another text


# -- 2. every input stands alone -----------------------------------------------------------------

BAD = [("/get_reward", {"query": ["fine", "fine too", "x", "bad \ud800 text"]}, "query[3]"),
       ("/classify", {"input": ["fine", "bad \ud800"]}, "input[1]"),
       ("/classify", {"input": "\ud800"}, "input"),
       ("/classify", {"messages": [[{"role": "user", "content": "a"}],
                                   [{"role": "user", "content": "b"}, {"role": "assistant", "content": "\udfff c"}]]},
        "messages[1][1].content"),
       ("/classify", {"messages": [{"role": "us\ud800er", "content": "a"}]}, "messages[0].role")]


def test_a_lone_surrogate_fails_its_own_request_and_no_other(server: Server) -> None:
    good = texts(20 - len(BAD), seed=7)
    alone = [_ok(server, "/get_reward", {"query": [q]})["rewards"][0] for q in good]
    start = threading.Barrier(20)

    def send(body: tuple[str, dict]) -> httpx.Response:
        start.wait(30)
        return _post(server, *body)

    bodies = [("/get_reward", {"query": [q]}) for q in good] + [(path, body) for path, body, _ in BAD]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(send, bodies))
    statuses = [a.status_code for a in answers]
    assert statuses == [200] * len(good) + [422] * len(BAD), [a.text[:200] for a in answers]
    assert [a.json()["rewards"][0] for a in answers[:len(good)]] == alone  # bit for bit, as alone
    for answer, (_, _, field) in zip(answers[len(good):], BAD):
        error = answer.json()["error"]
        assert error["field"] == field and "lone surrogate" in error["message"], error


# -- 3-5. size caps, unknown fields, empty texts --------------------------------------------------

@pytest.mark.parametrize("path, body, status, field, says", [
    # The size caps count every string a chat makes the server read, not only `content`.
    ("/classify", {"messages": [{"role": "r" * 70000, "content": "hi"}]}, 413, "messages", "70013 characters"),
    ("/classify", {"messages": [{"role": "user", "content": "hi", "name": "n" * 66000}]}, 413, "messages", "characters"),
    ("/classify", {"messages": [[{"role": "user", "content": "a"}], [{"role": "r" * 65540, "content": ""}]]}, 413,
     "messages[1]", "characters"),
    ("/classify", {"messages": [[{"role": "r" * 60000, "content": "x"}]] * 18}, 413, "messages", "max_work_chars"),
    # Unknown fields, with the closest known one.
    ("/classify", {"input": "a", "use_activaton": False}, 422, "use_activaton", "did you mean 'use_activation'"),
    ("/get_reward", {"query": ["a"], "promts": ["p"]}, 422, "promts", "did you mean 'prompts'"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 5}, 422, "truncate_prompt_tokens", "not supported"),
    ("/classify", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True}, 422,
     "add_generation_prompt", "not supported"),
    ("/classify", {"input": "a", "add_special_tokens": "no"}, 422, "add_special_tokens", "true or false"),
    # An empty text has nothing to score.
    ("/get_reward", {"query": ["fine", ""]}, 422, "query[1]", "empty"),
    ("/classify", {"input": ""}, 422, "input", "empty"),
])
def test_refusals_name_the_field(server: Server, path: str, body: dict, status: int, field: str, says: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["field"] == field and says in r.json()["error"]["message"], r.json()


def test_the_fields_trainers_and_vllm_send_are_accepted(server: Server) -> None:
    openrlhf = {"query": ["a text"], "prompts": ["a"], "labels": [None]}
    verl = {"model": "tiny", "input": "a text", "activation": False}
    vllm = {"model": "tiny", "input": ["a text"], "use_activation": None, "user": "u", "request_id": "r-1",
            "priority": 0, "truncate_prompt_tokens": -1, "add_special_tokens": True, "truncation_side": None}
    chat = {"messages": [{"role": "user", "content": "a text"}], "add_generation_prompt": False,
            "continue_final_message": False, "chat_template_kwargs": None, "add_special_tokens": False}
    assert _ok(server, "/get_reward", openrlhf)["rewards"]
    scores = [_ok(server, "/classify", b)["data"][0]["probs"][0] for b in (verl, {**vllm, "use_activation": False})]
    assert scores[0] == scores[1]
    assert _ok(server, "/classify", chat)["data"]


# -- 6. each table its own tokenizer settings ----------------------------------------------------

def test_two_tables_on_one_folder_keep_their_own_truncation_side(model: Path, tmp_path: Path) -> None:
    from rewardstack.config import from_dict
    from rewardstack.stack import RewardStack
    from rewardstack._service.batching import prepare_job, score_now

    config = from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), "rewards": {
        "left": {"path": str(model), "max_length": 32, "truncation_side": "left", "max_batch_tokens": 256},
        "right": {"path": str(model), "max_length": 32, "truncation_side": "right", "max_batch_tokens": 256}}})
    stack = RewardStack(config, load_state=False)
    long = [t for t in texts(40, seed=8) if len(_tok(model)(t)["input_ids"]) > 40][:4]
    job = prepare_job(stack, long, [f"query[{i}]" for i in range(len(long))], ["rewards.left", "rewards.right"],
                      time.monotonic() + 60)
    score_now(stack, [job])
    got = job.future.result(timeout=0).scores
    for side in ("left", "right"):
        want = reference_scores(model, long, max_length=32, side=side)
        assert max(abs(a - b) for a, b in zip(got[f"rewards.{side}"], want)) < TOL, side


def test_a_chat_the_template_renders_empty_is_refused(tmp_path: Path) -> None:
    from rewardstack.config import from_dict
    from rewardstack.stack import RewardStack
    from rewardstack.errors import InputError
    from rewardstack._service.batching import prepare_job, score_now

    folder = make_tiny_llama_rm(tmp_path / "plain", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    stack = RewardStack(from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), "rewards": {
        "plain": {"path": str(folder), "max_batch_tokens": 256}}}), load_state=False)
    empty = [{"role": "user", "content": ""}]
    with pytest.raises(InputError) as refused:  # refused while it is prepared, before it joins a slice
        prepare_job(stack, [[{"role": "user", "content": "hi"}], empty], ["messages[0]", "messages[1]"],
                    ["rewards.plain"], time.monotonic() + 60)
    assert refused.value.field == "messages[1]" and "empty" in str(refused.value)
    job = prepare_job(stack, [[{"role": "user", "content": "hi"}]], ["messages"], ["rewards.plain"], time.monotonic() + 60)
    score_now(stack, [job])
    assert job.future.result(timeout=0).scores["rewards.plain"]


# -- 8. /metrics ----------------------------------------------------------------------------------

def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_trainer_requests_batches_and_waits(server: Server) -> None:
    before = httpx.get(server.url + "/metrics").text
    queries = texts(6, seed=11)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda q: _ok(server, "/get_reward", {"query": [q, q]}), queries))
    assert _post(server, "/classify", {"input": ""}).status_code == 422
    _ok(server, "/classify", {"input": "one text"})
    after = httpx.get(server.url + "/metrics").text
    delta = lambda name, **labels: _metric(after, name, **labels) - _metric(before, name, **labels)  # noqa: E731
    assert delta("rewardstack_service_requests_total", route="/get_reward", code="200") == 6
    assert delta("rewardstack_service_requests_total", route="/classify", code="422") == 1
    assert delta("rewardstack_service_requests_total", route="/classify", code="200") == 1
    assert delta("rewardstack_trainer_queue_wait_seconds_count") == 7  # one per request scored
    assert delta("rewardstack_trainer_batch_inputs_sum") == 13
    assert 2 <= delta("rewardstack_trainer_batch_requests_count") < 7  # the six arrived together
    assert delta("rewardstack_trainer_batch_tokens_sum") > 13


# -- 9. the client --------------------------------------------------------------------------------

def test_the_client_splits_by_the_servers_limits(server: Server, model: Path) -> None:
    from rewardstack_client.trainers import RewardFunction

    limits = httpx.get(server.url + "/v1/models").json()["data"][0]["limits"]
    assert limits == {"max_inputs": 256, "max_chars": 65536, "max_work_chars": 1024**2}
    words = " ".join(texts(400, seed=3))
    prompts = [f"Question {k}: " for k in range(64)]
    completions = [words[k * 7:k * 7 + 20000] for k in range(64)]  # 1,281,000 characters in all: two requests
    assert _post(server, "/classify", {"input": [p + c for p, c in zip(prompts, completions)]}).status_code == 413
    with RewardFunction(server.url) as reward:
        got = reward(prompts=prompts, completions=completions)
        assert reward.requests == 2
        many = reward(prompts=["p "] * 300, completions=[f"c {k}" for k in range(300)])  # past max_inputs
        assert reward.requests == 4 and len(many) == 300
    want = reference_scores(model, [p + c for p, c in zip(prompts, completions)], max_length=64)
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL


def test_the_client_waits_out_a_full_queue(model: Path, tmp_path: Path) -> None:
    from rewardstack_client.trainers import RewardFunction, compute_score

    config = rewards_config(tmp_path, model, extra="\n[service]\nbatch_wait_s = 1.0\nstateless_queue = 1\n")
    server = Server(config).start().wait_ready(300)
    try:
        holder = threading.Thread(target=_ok, args=(server, "/classify", {"input": "holds the lane"}))
        holder.start()
        time.sleep(0.3)  # the holder waits a second for company in the lane's one place
        assert _post(server, "/classify", {"input": "refused"}).status_code == 429
        with RewardFunction(server.url) as reward:
            [got] = reward(prompts=["Score it: "], completions=["a summary"])  # 429, Retry-After: 1, then scored
        holder.join(60)
        threading.Thread(target=_ok, args=(server, "/classify", {"input": "holds it again"})).start()
        time.sleep(0.3)
        score = compute_score("ds", "a summary", None, {"prompt": "Score it: "}, url=server.url)
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    [want] = reference_scores(model, ["Score it: a summary"])
    assert abs(got - want) < TOL and abs(score - want) < TOL
    assert _metric(metrics, "rewardstack_service_requests_total", route="/classify", code="429") >= 3


# -- 7. a state file that cannot be read ---------------------------------------------------------

def test_an_unreadable_state_file_is_logged_once_and_refused_clearly(fake_config: Any, caplog: Any) -> None:
    from test_sessions import Live, step

    folder = Path(fake_config.state_dir) / "namespaces" / "broken"
    folder.mkdir(parents=True)
    (folder / "state.safetensors").write_bytes(b"not a safetensors file")
    live = Live(fake_config).start()
    try:
        with caplog.at_level(logging.WARNING, logger="rewardstack.service"):
            answers = [httpx.post(f"{live.url}/v1/score", json={**step("s"), "namespace": "broken"}, timeout=60)
                       for _ in range(3)]
            fine = httpx.post(f"{live.url}/v1/score", json={**step("s"), "namespace": "fine"}, timeout=60)
    finally:
        live.stop()
    assert fine.status_code == 200
    for r in answers:
        assert r.status_code == 500 and r.json()["error"]["type"] == "state_unreadable", r.text
        message = r.json()["error"]["message"]
        assert str(folder / "state.safetensors") in message and "move it aside" in message, message
    lines = [rec.getMessage() for rec in caplog.records if "state.safetensors" in rec.getMessage()]
    assert len(lines) == 1 and "move it aside" in lines[0], lines
