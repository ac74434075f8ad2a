"""Prompt-based judge: templates by task, score extraction, bounded input, batched = unbatched."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime, model_config
from rewardstack._scorers import judge
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_judge_standin
from tests.soak.synthetic import text


@pytest.fixture(scope="session")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> judge.JudgeScorer:
    folder = tmp_path_factory.mktemp("standins") / "judge"
    entry = make_judge_standin(folder)
    return judge.build(model_config("prompt_reward_model", folder, entry), make_runtime())


@pytest.mark.parametrize(
    ("generated", "expected"),
    [("7</Score>", 0.7), (" 10", 1.0), ("0", 0.0), ("15 then 3", 0.3), ("none", 0.0), ("", 0.0), ("x9", 0.0), ("11", 0.0), ("7.5", 0.7), ("\u0663", 0.0)],
)
def test_extract_score(generated: str, expected: float) -> None:
    assert judge.extract_score(generated) == pytest.approx(expected)


def test_template_choice() -> None:
    assert judge.template_for("augment") is judge.TEMPLATES["augment"]
    assert judge.template_for("followup2") is judge.TEMPLATES["followup"]
    assert judge.template_for("answer0") is judge.TEMPLATES["answer"]
    assert judge.template_for("summarize") is None
    for t in judge.TEMPLATES.values():
        assert "{prompt}" in t and "{completion}" in t and t.endswith("<Score>")


def test_other_task_scores_zero(scorer: judge.JudgeScorer) -> None:
    res = scorer.score(ScoreRequest("p", ["a", None], "mystery"))
    assert res.scores[0] == 0.0 and res.statuses == [Status.OK, Status.FAILED]


def test_bounded_input_cuts_middle(scorer: judge.JudgeScorer) -> None:
    rng = random.Random(0)
    comp = "START " + text(rng, 8000) + " FINISH"
    ids, cut = scorer.encode("prompt", comp, judge.TEMPLATES["answer"])
    assert cut and len(ids) <= scorer.max_len
    decoded = scorer.tokenizer.decode(ids)
    assert "start" in decoded and "finish" in decoded and "..." in decoded  # both ends kept
    short, was_cut = scorer.encode("prompt", "short answer", judge.TEMPLATES["answer"])
    assert not was_cut and len(short) < scorer.max_len


def test_batched_generation_equals_unbatched(scorer: judge.JudgeScorer) -> None:
    rng = random.Random(1)
    prompt = text(rng, 300)
    comps = [text(rng, rng.choice([5, 60, 300, 900])) for _ in range(8)]
    ids = [scorer.encode(prompt, c, judge.TEMPLATES["augment"])[0] for c in comps]
    with torch.inference_mode():
        batched = scorer.generate(ids)
        alone = [scorer.generate([x])[0] for x in ids]
    assert batched == alone


def test_scores_in_range(scorer: judge.JudgeScorer) -> None:
    rng = random.Random(2)
    comps = [text(rng, 100), None, text(rng, 5000), ""]
    res = scorer.score(ScoreRequest(text(rng, 200), comps, "answer1"))
    assert res.statuses[1] == Status.FAILED and math.isnan(res.scores[1])
    assert res.statuses[2] == Status.TRUNCATED
    for s in (res.scores[0], res.scores[2], res.scores[3]):
        assert 0.0 <= s <= 1.0
