"""Departures from openvalidators 1.2.0 that no other test pins (docs/SEMANTICS.md, last section)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from causal_fixtures import close, make_runtime, model_config
from rewardstack._scorers import dahoas, reciprocate
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_dahoas_standin, make_reciprocate_standin

FAST = {"calibration_length": 64}  # no budget here: the calibration's length bounds nothing


def test_dahoas_cuts_at_the_model_positions(tmp_path: Path) -> None:
    """Texts past GPT-J's 2,048 positions keep their first 2,048 tokens (status truncated); the
    reference ran any length (padding to 550, truncation off)."""
    folder = tmp_path / "dahoas"
    entry = make_dahoas_standin(folder)
    sc = dahoas.build(model_config("dahoas_reward_model", folder, entry, options=dict(FAST)), make_runtime())
    assert sc.max_len == 2048
    prompt, comp = "Say it again.", " value" * 2500

    def score_of_first_2048(text_: str) -> float:
        ids = sc.tokenizer(dahoas.wrap(text_)).input_ids
        ids = ids[: dahoas.read_position(ids, sc.eos_id) + 1][:2048]
        with torch.no_grad():
            h = sc.body(input_ids=torch.tensor([ids])).last_hidden_state
            return float(sc.head(h[0, -1]))

    res = sc.score(ScoreRequest(prompt, [comp, "a short answer"]))
    assert res.statuses == [Status.TRUNCATED, Status.OK]
    assert close(res.scores[0], score_of_first_2048(prompt + comp) - score_of_first_2048(comp), 1e-4)


def test_reciprocate_length_never_exceeds_the_model_positions(tmp_path: Path) -> None:
    """A tokenizer that allows 4,096 tokens on a model with 512 positions: inputs are cut at 512
    (the model's positions), not at the tokenizer's maximum."""
    folder = tmp_path / "reciprocate"
    entry = make_reciprocate_standin(folder)
    conf_file = folder / "tokenizer_config.json"
    conf = json.loads(conf_file.read_text())
    conf["model_max_length"] = 4096
    conf_file.write_text(json.dumps(conf))
    sc = reciprocate.build(model_config("reciprocate_reward_model", folder, entry, options=dict(FAST)), make_runtime())
    assert sc.tokenizer.model_max_length == 4096 and sc.max_len == 512
    prompt, comp = "Answer briefly.", " reward" * 900
    res = sc.score(ScoreRequest(prompt, [comp]))
    assert res.statuses == [Status.TRUNCATED]
    message = reciprocate.TEMPLATE.format(prompt=prompt, completion=comp)
    inputs = sc.tokenizer(message, return_tensors="pt", truncation=True, max_length=512)
    with torch.no_grad():
        assert close(res.scores[0], float(sc.model(**inputs).logits[0]), 1e-4)


@pytest.mark.parametrize("task", ["followup0", "answer3", "augment"])
def test_judge_maps_numbered_tasks(task: str) -> None:
    """The reference compared the name with `followup`/`answer` exactly (numbered steps scored 0)."""
    from rewardstack._scorers import judge

    assert judge.template_for(task) is not None
    assert judge.template_for("followups") is None and judge.template_for("summary") is None


def test_new_forward_pass_flag_opens_a_pass(fake_config) -> None:  # noqa: ANN001
    """The reference reset the blacklist at every `augment`; a step can also say so itself
    (`new_forward_pass`), which a replay starting mid-pass needs, and an `augment` marked false
    keeps the lists."""
    from rewardstack.stack import RewardStack

    stack = RewardStack(fake_config)

    def step(name: str, comps: list[str], **extra: object) -> dict:
        return {"name": name, "prompt": "p", "base_prompt": "b", "completions": comps, **extra}

    q = stack.score_step(step("followup0", ["what is x?", "why is y?"])).best
    res = stack.score_step(step("followup1", [q, "another question?"], new_forward_pass=True))
    assert res.normalized["blacklist_filter"] == [1.0, 1.0]  # the lists were reset
    q2 = res.best
    res = stack.score_step(step("augment", [q2, "a summary"], new_forward_pass=False))
    assert res.normalized["blacklist_filter"] == [0.0, 1.0]  # not reset: q2 is still a best question
