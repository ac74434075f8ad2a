"""The prompt-based judge against a literal transcription of openvalidators 1.2.0's.

The reference pads each filled template on the left to 2,048 tokens, generates 2 tokens greedily
from the ids alone (transformers infers the attention mask from the pad token), decodes the whole
output and cuts it at the filled text's character length, then parses with `\\b([0-9]|10)\\b`. The
scorer batches, pads only to the batch's longest input, passes the mask and decodes only the new
tokens: the same numbers wherever the tokenizer decodes the prompt back to its text (byte-level BPE
does). The reference's templates are injected into the scorer, and the tiny Llama's head favours
digit tokens so that the 2 generated tokens hold a score often enough for the test to mean something.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime
from ov_reference import TEMPLATES, as_scorer_template, reward_judge
from rewardstack.config import ModelConfig
from rewardstack._scorers import judge
from rewardstack._scorers.base import ScoreRequest, Status
from small_models import make_small_llama

# Words only: no tag name of the templates (the reference deletes those from its inputs).
WORDS = "the model answers a question about data memory budget token layer value reward miner prompt".split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> judge.JudgeScorer:
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("small") / "judge"
    tok = make_small_llama(folder, max_length=4096)
    model = LlamaForCausalLM.from_pretrained(str(folder))
    digits = [i for i in range(len(tok)) if tok.decode([i]).strip().isdigit()]
    assert len(digits) >= 5
    with torch.no_grad():  # digit tokens win the argmax often, and which one depends on the input
        model.lm_head.weight[digits] *= 4.0
    model.save_pretrained(str(folder), safe_serialization=True)
    cfg = ModelConfig(name="prompt_reward_model", path=str(folder), weight=1.0,
                      options={"calibration_length": 128})
    return judge.build(cfg, make_runtime())


@pytest.fixture
def reference_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(judge, "TEMPLATES", {k: as_scorer_template(v) for k, v in TEMPLATES.items()})


def _step(seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    prompt = _words(rng, 40)
    comps = [_words(rng, rng.choice([2, 6, 20, 60, 150])) for _ in range(9)]
    comps += ["the the the the the " * 40, "7", "a"]
    return prompt, comps


def test_judge_equals_literal_reference(scorer: judge.JudgeScorer, reference_templates: None) -> None:
    seen: set[float] = set()
    for seed, task in enumerate(("augment", "followup", "answer")):
        prompt, comps = _step(seed)
        res = scorer.score(ScoreRequest(prompt, comps, task))
        refs = [reward_judge(scorer.model, scorer.tokenizer, prompt, c, task) for c in comps]
        assert res.statuses == [Status.OK] * len(comps)
        assert res.scores == refs, task
        seen |= set(refs)
    assert len(seen) >= 3  # generation really produced different scores


def test_numbered_tasks_use_their_template(scorer: judge.JudgeScorer, reference_templates: None) -> None:
    """Departure: the reference compared the task name with `followup`/`answer` exactly, so the
    validator's `followup0`..`answer3` steps all scored 0. The scorer maps them to their template."""
    prompt, comps = _step(0)
    for numbered, plain in (("followup2", "followup"), ("answer0", "answer")):
        got = scorer.score(ScoreRequest(prompt, comps, numbered)).scores
        assert got == [reward_judge(scorer.model, scorer.tokenizer, prompt, c, plain) for c in comps]
        assert any(s > 0 for s in got)  # the template really scores
        hit = [c for c, s in zip(comps, got) if s > 0][:2]
        assert [reward_judge(scorer.model, scorer.tokenizer, prompt, c, numbered) for c in hit] == [0] * len(hit)
