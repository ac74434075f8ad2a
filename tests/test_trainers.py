"""The trainer routes against `rewardstack serve`, driven by the trainers' own request code.

A tiny LlamaForSequenceClassification reward model, built from a config and saved with
`save_pretrained` (tests/trainer_fixtures.py), served alone from a `[rewards.tiny]` table. OpenRLHF's
`_fetch_rewards_via_http` and verl's `compute_score_disrm` (copied verbatim: tests/trainer_clients.py)
and the client distribution's TRL and verl functions must get that model's own transformers forward
on the same text within 1e-5; identical inputs batched with any company get the same score bit for
bit; bad input is a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service_fixtures import Server
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts

pytest.importorskip("aiohttp")

TOL = 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(server, model folder): `rewardstack serve` on a config naming only `[rewards.tiny]`."""
    root = tmp_path_factory.mktemp("trainers")
    model = make_tiny_llama_rm(root / "tiny-rm")
    config = rewards_config(root, model, extra='max_length = 64\ntruncation_side = "left"')
    server = Server(config).start().wait_ready(300)
    try:
        yield server, model
    finally:
        server.stop()


def test_openrlhf_remote_rm_matches_the_models_own_forward(served: Any) -> None:
    from trainer_clients import OpenRLHFExecutor

    server, model = served
    queries = texts(12, seed=1) + texts(1, seed=1)  # the last repeats the first
    executor = OpenRLHFExecutor(server.url + "/get_reward")  # what --remote_rm_url names
    [answer] = asyncio.run(executor._fetch_rewards_via_http(queries, ["p"] * len(queries), [None] * len(queries)))
    # OpenRLHF's convention: the query is chat-templated, its BOS written in; nothing is added to it.
    want = reference_scores(model, queries, add_special_tokens=False, max_length=64, side="left")
    assert len(answer["rewards"]) == len(queries)
    assert max(abs(a - b) for a, b in zip(answer["rewards"], want)) < TOL
    assert answer["extra_logs"]["tiny"] == answer["rewards"] == answer["scores"]
    assert answer["rewards"][-1] == answer["rewards"][0]
    # Truncation is declared (max_length 64, cut on the left) and flagged per item.
    lengths = [len(ids) for ids in _tok(model)(queries, add_special_tokens=False)["input_ids"]]
    assert answer["extra_logs"]["truncated"] == [float(n > 64) for n in lengths]
    assert any(n > 64 for n in lengths) and any(n <= 64 for n in lengths)
    # OpenRLHF's own default: one query per request, many requests at once (sharded over two URLs).
    two = OpenRLHFExecutor([server.url + "/get_reward"] * 2)
    got = asyncio.run(two._fetch_rewards_via_http(queries[:2], ["p", "q"], ["a", "b"]))
    assert [g["rewards"][0] for g in got] == answer["rewards"][:2]


def test_verl_reward_model_path_matches_the_models_own_forward(served: Any) -> None:
    from trainer_clients import VerlRewardLoopWorker

    server, model = served
    tok = _tok(model)
    config = _ns(reward_model=_ns(rollout=_ns(name="vllm"), model=_ns(path=str(model))))
    worker = VerlRewardLoopWorker(config, server.url.removeprefix("http://"), tok, tok)
    chat = [{"role": "user", "content": "Rate this summary question"}]
    response = "a text summary it is"
    data = _data_proto(tok, chat, response)
    got = asyncio.run(worker.compute_score_disrm(data))["reward_score"]
    rendered = tok.apply_chat_template(chat + [{"role": "assistant", "content": response}], tokenize=False)
    # verl strips the BOS the template wrote and /classify adds it back (vLLM's convention): one BOS.
    [want] = reference_scores(model, [rendered], add_special_tokens=False, max_length=64, side="left")
    assert abs(got - want) < TOL
    # verl reads /v1/models and /health as vLLM's.
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny"]


def test_trl_and_verl_client_functions(served: Any) -> None:
    from rewardstack_client.trainers import RewardFunction, compute_score

    server, model = served
    tok = _tok(model)
    reward = RewardFunction(server.url, model="tiny")
    prompts, completions = ["Score it: ", "Rate the question "], ["a summary", "from 0 to 10"]
    got = reward(prompts=prompts, completions=completions, completion_ids=None)
    want = reference_scores(model, [p + c for p, c in zip(prompts, completions)])
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
    chats = [[{"role": "user", "content": "Here is a text"}]]
    answer = [[{"role": "assistant", "content": "summary it is"}]]
    [got_chat] = reward(prompts=chats, completions=answer)
    rendered = tok.apply_chat_template(chats[0] + answer[0], tokenize=False)
    [want_chat] = reference_scores(model, [rendered], add_special_tokens=False, max_length=64, side="left")
    assert abs(got_chat - want_chat) < TOL
    reward.close()
    score = compute_score("ds", "summary it is", None, {"prompt": chats[0]}, url=server.url)
    assert abs(score - want_chat) < TOL


def test_requests_sent_together_share_forward_passes_and_keep_their_scores(served: Any) -> None:
    server, model = served
    queries = texts(24, seed=5)
    alone = [_post(server, "/get_reward", {"query": [q]})["rewards"][0] for q in queries]
    before = httpx.get(server.url + "/v1/stack").json()["trainer"]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        together = list(pool.map(lambda q: _post(server, "/get_reward", {"query": [q]})["rewards"][0], queries))
    after = httpx.get(server.url + "/v1/stack").json()["trainer"]
    assert together == alone  # bit for bit, whatever the company
    assert after["requests"] - before["requests"] == 24
    assert after["batches"] - before["batches"] < 24  # some arrived together and shared a batch


@pytest.mark.parametrize("path, body, status, field", [
    ("/get_reward", {"prompts": ["a"]}, 422, "query"),
    ("/get_reward", {"query": ["a", "b"], "prompts": ["a"]}, 422, "prompts"),
    ("/get_reward", {"query": ["a"], "labels": "x"}, 422, "labels"),
    ("/get_reward", {"query": ["a", 3]}, 422, "query[1]"),
    ("/get_reward", {"query": []}, 422, "query"),
    ("/get_reward", {"query": ["a"] * 300}, 413, "query"),
    ("/get_reward", {"query": ["a" * 70000]}, 413, "query[0]"),
    ("/classify", {"model": "nope", "input": "a"}, 404, "model"),
    ("/classify", {"input": "a", "messages": []}, 422, "input"),
    ("/classify", {"messages": [{"role": "user"}]}, 422, "messages[0]"),
    ("/classify", {"input": "a", "use_activation": "no"}, 422, "use_activation"),
])
def test_bad_input_is_refused_naming_the_field(served: Any, path: str, body: dict, status: int, field: str) -> None:
    server, _ = served
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["field"] == field


def test_bad_json_and_content_type(served: Any) -> None:
    server, _ = served
    r = httpx.post(server.url + "/get_reward", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    r = httpx.post(server.url + "/classify", content=b'{"input": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_activation_is_a_sigmoid_as_vllm_does(served: Any) -> None:
    server, _ = served
    raw = _post(server, "/classify", {"input": "Here is a text", "use_activation": False})["data"][0]["probs"][0]
    p = _post(server, "/classify", {"input": "Here is a text"})["data"][0]["probs"][0]
    assert abs(p - float(torch.sigmoid(torch.tensor(raw)))) < 1e-6


def test_copies_match_the_fetched_sources() -> None:
    """With REWARDSTACK_TRAINER_SOURCES=<OpenRLHF git dir>:<verl git dir>, the copies are verbatim
    (serve_rm.py's but for the four import lines its model loader replaces: tests/openrlhf_serve_rm.py)."""
    dirs = os.environ.get("REWARDSTACK_TRAINER_SOURCES")
    if not dirs:
        pytest.skip("REWARDSTACK_TRAINER_SOURCES names no fetched OpenRLHF and verl git directories")
    show = lambda git_dir, path: subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{path}"], check=True,  # noqa: E731
                                                capture_output=True, text=True).stdout
    copy = (Path(__file__).parent / "trainer_clients.py").read_text()
    for git_dir, path in zip(dirs.split(":"), ("openrlhf/utils/agent.py", "verl/experimental/reward_loop/reward_loop.py")):
        block = copy.split(f" {path}\n", 1)[1].split("    # END")[0]
        assert block in show(git_dir, path)
    serve_rm = (Path(__file__).parent / "openrlhf_serve_rm.py").read_text()
    block = serve_rm.split("# BEGIN OpenRLHF openrlhf/cli/serve_rm.py\n", 1)[1].split("# END OpenRLHF")[0]
    removed = serve_rm.split("model loader: these four import lines were taken out,\n\n", 1)[1].split("\n\n", 1)[0]
    source = show(dirs.split(":")[0], "openrlhf/cli/serve_rm.py")
    assert block == source.replace("".join(line.strip() + "\n" for line in removed.splitlines()), "")


# -- helpers ---------------------------------------------------------------------------------------

def _tok(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _post(server: Server, path: str, body: dict) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def _data_proto(tok: Any, chat: list, response: str) -> Any:
    """What verl's `_preprocess_reward_inputs` reads of a one-item DataProto: the raw prompt, the
    right-padded response ids and the attention mask whose tail covers them."""
    ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.pad_token_id] * 3
    mask = torch.tensor([1] * 5 + [1] * (len(ids) - 3) + [0] * 3)
    item = _ns(batch={"responses": torch.tensor(ids), "attention_mask": mask},
               non_tensor_batch={"raw_prompt": chat})

    class Data:
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> Any:
            return item

    return Data()
