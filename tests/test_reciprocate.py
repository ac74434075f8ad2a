"""Reciprocate scorer: parity with a literal per-completion GPT-J classifier call, truncation."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import close, make_runtime, model_config
from rewardstack._scorers import reciprocate
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_reciprocate_standin
from tests.soak.synthetic import text


@pytest.fixture(scope="session")
def rec_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("standins") / "reciprocate"
    return folder, make_reciprocate_standin(folder)


@pytest.fixture(scope="session")
def scorer(rec_folder: tuple[Path, dict]) -> reciprocate.ReciprocateScorer:
    folder, entry = rec_folder
    return reciprocate.build(model_config("reciprocate_reward_model", folder, entry), make_runtime())


def reference(sc: reciprocate.ReciprocateScorer, prompt: str, completion: str) -> float:
    """The spec, literally: one unpadded input, truncation to the tokenizer's max length."""
    message = f"<|prompter|>{prompt}</s><|assistant|>{completion}</s><|endoftext|>"
    inputs = sc.tokenizer(message, return_tensors="pt", truncation=True)
    with torch.no_grad():
        return float(sc.model(**inputs).logits[0])


def test_parity_mixed_lengths(scorer: reciprocate.ReciprocateScorer) -> None:
    rng = random.Random(1)
    prompt = text(rng, 400)
    comps: list[str | None] = [text(rng, rng.choice([0, 5, 40, 300, 900, 1500])) for _ in range(40)]
    comps += ["", "ü 🙂 東京", None, text(rng, 5000)]
    res = scorer.score(ScoreRequest(prompt, comps))
    for c, s, st in zip(comps, res.scores, res.statuses):
        if c is None:
            assert st == Status.FAILED and math.isnan(s)
            continue
        assert close(s, reference(scorer, prompt, c), 1e-4), c[:40]
    assert res.statuses[-1] == Status.TRUNCATED  # 5,000 characters is past the 512-token bound
    assert res.statuses[0] in (Status.OK, Status.TRUNCATED)


def test_prefix_does_not_change_numbers(rec_folder: tuple[Path, dict], scorer: reciprocate.ReciprocateScorer) -> None:
    folder, entry = rec_folder
    plain = reciprocate.build(
        model_config("reciprocate_reward_model", folder, entry, options={"shared_prefix": False}), make_runtime()
    )
    rng = random.Random(2)
    prompt = text(rng, 300)
    comps = [text(rng, rng.randint(0, 600)) for _ in range(10)]
    a = scorer.score(ScoreRequest(prompt, comps)).scores
    b = plain.score(ScoreRequest(prompt, comps)).scores
    assert all(close(x, y) for x, y in zip(a, b))


def test_read_position_rule() -> None:
    assert reciprocate.read_position([5, 6, 7], None) == 2
    assert reciprocate.read_position([5, 6, 0, 0], 0) == 1  # rightmost non-pad
    assert reciprocate.read_position([0, 0], 0) == 0


def test_all_failed(scorer: reciprocate.ReciprocateScorer) -> None:
    res = scorer.score(ScoreRequest("p", [None]))
    assert res.statuses == [Status.FAILED]


def test_one_call_tokenization_matches_the_tokenizer_at_the_bound(scorer: reciprocate.ReciprocateScorer) -> None:
    """Ids, types and "was cut" from the single overflow call equal separate truncated and
    untruncated calls, for texts just under, at and just over the bound, and very long ones."""
    tok, bound = scorer.tokenizer, 64
    words = [f"w{k}" for k in range(200)]
    texts = [" ".join(words[:n]) for n in (1, 20, 29, 30, 31, 32, 33, 60, 199)] + ["", "x" * 3000]
    ids, cut, types = reciprocate.tokenize_bounded(tok, texts, bound)
    want = tok(texts, truncation=True, max_length=bound)
    full = tok(texts)["input_ids"]
    assert ids == [list(x) for x in want["input_ids"]]
    assert types == [list(x) for x in want["token_type_ids"]]
    assert cut == [len(f) > bound for f in full]
    assert any(cut) and not all(cut) and any(len(f) == bound for f in full)  # the bound itself is covered
