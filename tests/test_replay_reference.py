"""What the unbounded reference would have asked for, for the embedding masks: relevance (its two
encoders, the first on every overflow window of the text at once) and diversity (the step's
completions in one batch), counted with the scorers' own tokenizers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import use_builder
from rewardstack import config as config_mod
from rewardstack._replay.readers import RunStep
from rewardstack._replay.reference import reference_need_of
from rewardstack._replay.replay import format_report, replay
from rewardstack.stack import RewardStack, Step
from tests.soak.synthetic import text


@pytest.fixture(scope="module")
def embedding_stack_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Relevance and diversity on their stand-ins (MiniLM), OpenAssistant alone weighted (a fake in
    the test), NSFW off."""
    from rewardstack._standins import make_diversity_standin, make_relevance_standin

    root = tmp_path_factory.mktemp("embedding_standins")
    rel = make_relevance_standin(root / "relevance_filter")
    div = make_diversity_standin(root / "diversity_reward_model")
    models: dict = {m: {"weight": 0.0} for m in ("dpo_reward_model", "rlhf_reward_model", "reciprocate_reward_model",
                                                 "dahoas_reward_model", "prompt_reward_model")}
    models["rlhf_reward_model"] = {"weight": 1.0}
    models["nsfw_filter"] = {"enabled": False}
    models["relevance_filter"] = {"paths": [str(root / p) for p in rel["paths"]], "dtype": "float32"}
    models["diversity_reward_model"] = {"path": str(root / div["path"]), "dtype": "float32"}
    return {"device": "cpu", "models": models}


def test_relevance_and_diversity_reference_need_is_computed(embedding_stack_config: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardstack._planning.simulate import reference_need, simulate_peak

    use_builder(monkeypatch, "rlhf_reward_model", "fakes:build")  # the weights must sum to 1: a reward model, cheap
    rng = random.Random(3)
    # 1,533 one-token words: 1,535 tokens with [CLS] and [SEP], 4 windows of 510 content tokens (the
    # last holding 3), where a count that forgot the special tokens would make 3 of 512.
    long = " ".join(["river"] * 1_533)
    step = Step.from_dict({"name": "augment", "prompt": "Tell me about " + text(rng, 80),
                           "completions": [text(rng, 200), long, text(rng, 300)]})
    stack = RewardStack(config_mod.from_dict({**embedding_stack_config, "state_dir": str(tmp_path / "s")}), load_state=False)
    report = replay(stack, [RunStep(step, "test:1")], top=1)

    rel = report.top["relevance_filter"][0]
    assert rel.index == 1 and rel.tokens is not None and rel.tokens > 1_500, rel
    # The first encoder embeds every window of the text in one batch: as many as the tokenizer's
    # own overflow makes (the reference's call), each of 512 tokens.
    tok = stack.scorers["relevance_filter"].first.tokenizer
    windows = len(tok(long, truncation=True, max_length=512, return_overflowing_tokens=True)["input_ids"])
    assert windows > 2 and f"{windows} windows of 512 tokens" in rel.reference_note, (windows, rel.reference_note)
    # That batch asks for more than the second encoder's pass at its 512-token bound: the figure.
    first = simulate_peak("relevance_filter[0]", windows, 512, padded=True, exact=False).peak_bytes
    second = reference_need("relevance_filter[1]", 512).peak_bytes
    assert first > second and rel.reference_bytes == first, (rel, first, second)

    # Diversity embeds with relevance's second encoder (one pass, measured under relevance), so it
    # has no peak of its own here: its figure asked for directly.
    tokens, need, _, note = reference_need_of(stack.scorers["diversity_reward_model"], "diversity_reward_model", step, 1)
    assert tokens is not None and tokens > 1_500 and need is not None, note
    # All three completions in one batch, padded to the bound: more than the long one alone.
    assert need > reference_need("diversity_reward_model", 512).peak_bytes, note
    assert "3 completions in one batch" in note, note

    out = format_report(report)
    assert "no tokenizer" not in out and "the unbounded reference would have needed" in out, out
