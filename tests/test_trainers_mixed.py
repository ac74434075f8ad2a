"""Trainers and a validator on one service: the validator's steps keep their order and are applied
exactly once while trainer requests are batched between its turns; the trainer routes take the
service's tokens off loopback.

The real app and worker on a loopback port in this process (tests/test_sessions.py's `Live`), the
validator models faked (tests/fakes.py), a tiny saved HF reward model as `[rewards.tiny]`.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from rewardstack.config import from_dict  # noqa: E402
from rewardstack_client import Client, RetryPolicy  # noqa: E402

from test_sessions import Live, kept_prompts, step  # noqa: E402
from trainer_fixtures import make_tiny_llama_rm, texts  # noqa: E402


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_rm(tmp_path_factory.mktemp("tiny-rm") / "rm")


def mixed_config(tmp_path: Path, model: Path, **service: Any) -> Any:
    return from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), "models": {},
                      "rewards": {"tiny": {"path": str(model)}}, "service": service})


def test_a_validators_steps_keep_their_order_while_trainers_send(fake_registry, tiny_rm: Path,  # noqa: ANN001
                                                                  tmp_path: Path) -> None:
    live = Live(mixed_config(tmp_path, tiny_rm)).start()
    try:
        inputs = texts(16, seed=5)
        alone = [httpx.post(f"{live.url}/classify", json={"input": t}, timeout=60).json()["data"][0]["probs"][0]
                 for t in inputs[:4]]
        answers: list[Any] = []
        errors: list[BaseException] = []

        def trainer(k: int) -> None:
            try:
                with httpx.Client(base_url=live.url, timeout=120) as c:
                    for j in range(6):
                        i = (k + j) % len(inputs)
                        answers.append((i, c.post("/classify", json={"input": inputs[i]}).json()))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        trainers = [threading.Thread(target=trainer, args=(k,)) for k in range(8)]
        for t in trainers:
            t.start()
        validator = Client(live.url, namespace="v", retry=RetryPolicy(deadline_s=120))
        events = [validator.score(step(f"v{k}")) for k in range(12)]
        for t in trainers:
            t.join(120)
        assert not errors, errors[:2]
        assert [e["sequence"] for e in events] == list(range(1, 13))
        assert kept_prompts(live, "v") == {k + 1: f"prompt v{k}?" for k in range(12)}  # in order, once each
        assert live.standing("v")["next"] == 13
        assert len(answers) == 48 and all("data" in a for _, a in answers), answers[:2]
        for i, a in answers:  # the same input, the same score, whatever it was batched with
            if i < 4:
                assert a["data"][0]["probs"][0] == alone[i]
        assert live.worker.lane.batches < 48  # requests shared forward passes
    finally:
        live.stop()


def test_the_trainer_routes_need_the_services_token(fake_registry, tiny_rm: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from rewardstack._service.access import Access

    token = "trainer-token-for-the-tests"
    live = Live(mixed_config(tmp_path, tiny_rm), Access({hashlib.sha256(token.encode()).hexdigest(): "*"})).start()
    try:
        bearer = {"Authorization": f"Bearer {token}"}
        for route, payload in (("/classify", {"input": "a question and its answer"}),
                               ("/get_reward", {"query": ["a question and its answer"]}), ("/v1/models", None)):
            call = httpx.get if payload is None else lambda url, **kw: httpx.post(url, json=payload, **kw)
            refused = call(live.url + route, timeout=60)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized", refused.text
            ok = call(live.url + route, timeout=60, headers=bearer)
            assert ok.status_code == 200, ok.text
    finally:
        live.stop()
