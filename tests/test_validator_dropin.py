"""The openvalidators drop-in driven by the validator's own forward pass (ov_validator.py).

With openvalidators 1.2.0's real `forward.py` where this machine has its source (the `real`
cases), and its transcription everywhere (CI): concurrent forward passes as `run.py` gathers them,
the events `EventSchema` receives, the wandb row of each step, and the event loop kept free by
`score_step`. The stack scoring the steps is the in-process one (`OpenValidatorsStack.local`);
the service is the backend in test_validator_service.py.
"""

from __future__ import annotations

from collections import Counter

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rewardstack.config import load_config
from rewardstack._fileio import event_line
from rewardstack.integrations.openvalidators import OpenValidatorsStack
from rewardstack.stack import RewardStack
from rewardstack_client import WeightsMismatch
from rewardstack_client.openvalidators import MASKS, REWARD_MODELS

import ov_validator as ov
from service_fixtures import write_config

SOURCE = ov.real_source()
MODULES = ["transcription"] + (["real"] if SOURCE is not None else [])
"""The real forward.py only where its source is here (never committed; CI runs the transcription)."""
TEXTS = [". ".join(f"Sentence {i} of text {t} about topic {t * 3 + i}" for i in range(40)) + "." for t in range(8)]


def forward_module(which: str, *, prescore: bool = False) -> Any:
    if which == "real":
        assert SOURCE is not None
        return ov.real_forward_module(SOURCE, prescore=prescore)
    return ov.transcription


@pytest.fixture(scope="module")
def stack_config(standins: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(standins, tmp_path_factory.mktemp("dropin") / "state", "dropin")


@pytest.fixture(scope="module")
def stack(stack_config: Path) -> RewardStack:
    return RewardStack(load_config(stack_config), load_state=False)


def recording(rs_factory: Any, stack: RewardStack) -> tuple[OpenValidatorsStack, list[dict[str, Any]]]:
    """A local drop-in over a fresh state of `stack`, recording each step body it commits, in order."""
    stack.state = stack.new_state()
    sent: list[dict[str, Any]] = []
    rs = OpenValidatorsStack.local(stack)
    score = rs._session.score

    def record(body: dict[str, Any]) -> dict[str, Any]:
        sent.append(dict(body))
        return score(body)

    rs._session.score = record
    return rs, sent


def reference_events(stack: RewardStack, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stack's events for the same steps, scored in the same order against a fresh state."""
    state = stack.new_state()
    return [json.loads(event_line(state.apply(stack.forward(b)).event)) for b in bodies]


@pytest.mark.parametrize("which", MODULES)
def test_two_concurrent_forward_passes_get_the_stacks_rewards(which: str, stack: RewardStack) -> None:
    rs, sent = recording(OpenValidatorsStack.local, stack)
    neuron = ov.FakeNeuron(rs, passes_data=TEXTS)
    ov.run_forwards(forward_module(which), neuron, concurrent=2, rounds=2)
    rows = ov.events_of(neuron)
    assert len(rows) == len(sent) == 4 * 5  # 2 rounds x 2 passes x (augment + 2 followups + 2 answers)
    # The steps of the two passes did interleave (the case the shared session broke).
    assert [b.get("new_forward_pass", False) for b in sent[:2]] == [True, True]
    want = reference_events(stack, sent)
    for row in rows:
        seq = row["rewardstack/sequence"]
        ref = want[seq - 1]
        assert row["name"] == ref["name"] and row["prompt"] == ref["prompt"]
        assert torch.allclose(torch.tensor(row["rewards"]), torch.tensor(ref["rewards"], dtype=torch.float32),
                              rtol=1e-6, atol=1e-7), (row["rewards"], ref["rewards"])
        assert row["best"] == ref["best"]
    # No mask got another base prompt than the step was scored with (StepMismatch), nothing warned.
    assert not ov.WARNINGS.lines, ov.WARNINGS.lines[:4]


@pytest.mark.parametrize("which", MODULES)
def test_every_event_field_is_logged_with_zeros_for_models_that_are_off(which: str, stack: RewardStack) -> None:
    rs, _ = recording(OpenValidatorsStack.local, stack)
    neuron = ov.FakeNeuron(rs, passes_data=TEXTS, followups=1)
    ov.run_forwards(forward_module(which), neuron, concurrent=1)
    rows = ov.events_of(neuron)
    assert rows and not ov.WARNINGS.lines, ov.WARNINGS.lines[:4]
    cfg = stack.config
    off = [n for n in REWARD_MODELS if cfg.models[n].weight == 0] + [n for n in MASKS if not cfg.models[n].active]
    assert "dpo_reward_model" in off and "relevance_filter" in off  # the config switches some off
    for row in rows:
        for key in ov.EVENT_FIELDS:
            assert row.get(key) is not None, key
        for name in off:
            assert row[name] == [0.0] * len(row["completions"]), name
    # A mask that is off does not multiply the rewards by its zeros: some reward is positive.
    assert any(r > 0 for row in rows for r in row["rewards"])


def test_same_name_and_completions_with_another_prompt_is_scored_anew(stack: RewardStack) -> None:
    rs, sent = recording(OpenValidatorsStack.local, stack)
    responses = [ov.Call("the same answer"), ov.Call("and another one"), ov.Call("a third")]
    rlhf = rs.reward_functions[REWARD_MODELS.index("rlhf_reward_model")]
    first, _ = rlhf.apply("What is the capital of France?", responses, "augment")
    second, _ = rlhf.apply("Summarize the history of tea in a line.", responses, "augment")
    assert [b["prompt"] for b in sent] == ["What is the capital of France?", "Summarize the history of tea in a line."]
    want = reference_events(stack, sent)
    assert second.tolist() == pytest.approx(want[1]["rlhf_reward_model"], rel=1e-6)
    assert not torch.allclose(first, second)


# -- the mechanisms, on a backend without models -----------------------------------------------------

def fake_backend(delay: float = 0.0, statuses: list[str] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """A backend answering every field from the step's texts, after `delay` seconds of 'scoring'."""
    sent: list[dict[str, Any]] = []

    def score(body: dict[str, Any]) -> dict[str, Any]:
        time.sleep(delay)
        sent.append(body)
        n = len(body["completions"])
        event: dict[str, Any] = {"sequence": len(sent), "best": body["completions"][0] or "",
                                 "statuses": statuses or ["ok"] * n,
                                 "memory": {"peak_bytes": 1234, "models": {"rlhf_reward_model": 999}}}
        for name in REWARD_MODELS + MASKS:
            event[name] = [float(len(body["prompt"]) + i) for i in range(n)]
            event[name + "_normalized"] = [1.0] * n
        return event

    return score, sent


def test_score_step_keeps_the_validators_event_loop_free() -> None:
    score, sent = fake_backend(delay=1.2)
    rs = OpenValidatorsStack(score, {"rlhf_reward_model": 1.0}, list(MASKS), wandb=None)
    responses = [ov.Call("a"), ov.Call("b")]

    def largest_gap(prescore: bool) -> float:
        gaps: list[float] = []

        async def ticker(stop: asyncio.Event) -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.1)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def step(prompt: str) -> None:
            if prescore:
                await rs.score_step(prompt, responses, "augment")
            for fn in rs.reward_functions + rs.masking_functions:
                fn.apply(prompt, responses, "augment")

        async def main() -> None:
            stop = asyncio.Event()
            t = asyncio.ensure_future(ticker(stop))
            await asyncio.sleep(0.25)
            await step(f"prompt {len(sent)}")
            await asyncio.sleep(0.25)
            stop.set()
            await t

        asyncio.run(main())
        return max(gaps)

    assert largest_gap(prescore=True) < 0.5
    assert largest_gap(prescore=False) > 1.0  # apply alone blocks the loop: the ticker sees it
    assert len(sent) == 2  # one commit per step, the applies after score_step answered from it


def test_the_steps_record_lands_in_its_own_wandb_row_and_unscored_completions_are_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    score, sent = fake_backend(statuses=["ok", "oom", "ok"])
    wandb = ov.FakeWandb()
    rs = OpenValidatorsStack(score, {"rlhf_reward_model": 1.0}, list(MASKS), wandb=wandb)
    neuron = ov.FakeNeuron(rs, passes_data=TEXTS, followups=1, k=3)
    neuron.wandb = wandb
    with caplog.at_level(logging.WARNING, logger="rewardstack_client"):
        ov.run_forwards(ov.transcription, neuron, concurrent=2)
    assert len(wandb.rows) == len(sent) == 6
    for row in wandb.rows:
        body = sent[row["rewardstack/sequence"] - 1]
        assert row["prompt"] == body["prompt"]  # the record joined its own step's row
        assert row["rewardstack/statuses/oom"] == 1 and row["rewardstack/unscored"] == [1]
        assert row["rewardstack/_memory/peak_bytes"] == 1234
        assert row["rewardstack/_memory/models/rlhf_reward_model"] == 999
    assert sum("not scored (oom)" in r.getMessage() for r in caplog.records) == 6


def test_the_validators_weight_flags_are_checked_against_the_service() -> None:
    from rewardstack_client.openvalidators import check_weights

    served = {"dpo_reward_model": 0.3, "rlhf_reward_model": 0.4, "reciprocate_reward_model": 0.3}
    check_weights(torch.tensor([0.3, 0.4, 0.3, 0.0, 0.0]), served)  # the validator's defaults: agree
    with pytest.raises(WeightsMismatch, match=r"--reward\.rlhf_weight is 0\.6 here but 0\.4"):
        check_weights(torch.tensor([0.3, 0.6, 0.1, 0.0, 0.0]), served)


def test_the_validators_save_and_load_of_the_diversity_model_do_not_warn(tmp_path: Path) -> None:
    score, _ = fake_backend()
    rs = OpenValidatorsStack(score, {}, list(MASKS), wandb=None)
    model = rs.diversity_model
    # openvalidators 1.2.0 utils.save_state / load_state, the diversity part (their try blocks).
    path = tmp_path / "diversity_model.pth"
    torch.save({"historic_embeddings": model.historic_embeddings.to("cpu")}, path)
    model.historic_embeddings = torch.load(path)["historic_embeddings"].to("cpu")
    assert list(model.historic_embeddings.shape) == [0]


def test_concurrent_passes_commit_each_step_once_from_threads() -> None:
    score, sent = fake_backend(delay=0.05)
    rs = OpenValidatorsStack(score, {"rlhf_reward_model": 1.0}, list(MASKS), wandb=None)
    neuron = ov.FakeNeuron(rs, passes_data=TEXTS, followups=1, k=3)
    neuron.prescore = True
    ov.run_forwards(ov.transcription, neuron, concurrent=3)
    # Each step the validator ran was sent once, and only those: the steps sent and the steps in
    # the validator's events are the same multiset. (Two passes may draw the same miners and ask
    # the very same step, seen on CI as 8 distinct steps of 9; then both sides hold it twice. A
    # step sent twice and another never would leave the two sides different.)
    def step(d: dict) -> tuple:  # the drop-in sends completions stripped, an empty one as null
        return d["name"], d["prompt"], tuple((c or "").strip() for c in d["completions"])

    events = ov.events_of(neuron)
    assert len(sent) == len(events) == 9
    assert Counter(step(b) for b in sent) == Counter(step(e) for e in events)
    # ... and each step's values are its own answer's (the fake answers len(prompt) + i).
    for e in events:
        assert e["rlhf_reward_model"] == [float(len(e["prompt"]) + i) for i in range(len(e["completions"]))]
    assert sum(bool(b.get("new_forward_pass")) for b in sent) == 3
