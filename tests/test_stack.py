"""The stack: combination, masks, events, edge cases and persistence (fake model scorers)."""

from __future__ import annotations

import math

import pytest
import torch

from rewardstack import RewardStack
from rewardstack.config import ALL_MODELS, from_dict
from rewardstack._models import DIVERSITY as _DIVERSITY
from rewardstack.errors import InputError
from rewardstack._state import RunningNormalizer
from rewardstack.stack import Step

from conftest import use_builder
from fakes import text_score

DIVERSITY = _DIVERSITY.name
EVENT_FIELDS = {
    "name", "prompt", "completions", "uids", "completion_times", "rewards", "best", "step_length",
    "block", "gating_loss", "set_weights",
}


def _step(completions, name="augment", prompt="Summarize the text.", base="The text."):  # noqa: ANN001, ANN201
    return {"name": name, "prompt": prompt, "base_prompt": base, "completions": completions}


def test_event_has_every_spec_field(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    ev = stack.score_step(_step(["one answer here", "another answer"])).event
    want = EVENT_FIELDS | set(ALL_MODELS) | {n + "_normalized" for n in ALL_MODELS}
    assert want <= set(ev)
    assert ev["dahoas_reward_model"] == [0.0, 0.0] and ev["prompt_reward_model_normalized"] == [0.0, 0.0]


def test_the_event_as_written_is_the_wire_schemas_event(fake_config) -> None:  # noqa: ANN001
    import json

    from pydantic import ValidationError

    from rewardstack._fileio import event_line
    from rewardstack._service.protocol import ANSWER_SCHEMA
    from rewardstack._wire import EventWire

    stack = RewardStack(fake_config)
    ev = json.loads(event_line(stack.score_step(_step(["NAN", "fine text", None])).event))  # NaN -> null
    EventWire.model_validate(ev)
    # Every field the event has is declared (the service's OpenAPI answer), and nothing else.
    assert set(ANSWER_SCHEMA["properties"]) == set(ev) | {"sequence"}
    assert set(ANSWER_SCHEMA["required"]) == set(ev) | {"sequence"}
    for broken in ({k: v for k, v in ev.items() if k != "relevance_filter"}, ev | {"rewards": ["x", 1.0, 0.0]}):
        with pytest.raises(ValidationError):
            EventWire.model_validate(broken)


def test_combination_matches_hand_computation(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    comps = ["alpha one", "beta two", "gamma bad three", "That is an excellent question."]
    res = stack.score_step(_step(comps))
    weights = {"dpo_reward_model": 0.3, "rlhf_reward_model": 0.4, "reciprocate_reward_model": 0.3}
    want = [0.0] * 4
    for name, w in weights.items():
        raw = [text_score(name, c) for c in comps]
        assert res.raw[name] == raw
        norm = RunningNormalizer()(raw)
        assert res.normalized[name] == pytest.approx(norm)
        want = [a + w * b for a, b in zip(want, norm)]
    masks = [1.0, 1.0, 0.0, 0.0]  # fake masks zero 'bad'; the blacklist zeros the stock phrase
    want = [a * m for a, m in zip(want, masks)]
    assert res.rewards == pytest.approx(want)
    assert res.best == comps[max(range(4), key=lambda i: want[i])]


def test_no_completions(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    res = stack.score_step(_step([]))
    assert res.rewards == [] and res.best == "" and res.statuses == []
    assert all(stack.normalizers[n].count == 0 for n in stack.normalizers)


def test_one_completion(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    res = stack.score_step(_step(["a single answer"]))
    assert res.normalized["rlhf_reward_model"] == [0.5]
    assert stack.normalizers["rlhf_reward_model"].var == 0.0
    res = stack.score_step(_step(["x one", "y two"]))
    assert all(math.isfinite(r) for r in res.rewards)


def test_nan_raw_score_is_explicit_and_kept_out(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    res = stack.score_step(_step(["NAN", "fine text", "more text"]))
    assert math.isnan(res.raw["dpo_reward_model"][0])
    assert res.normalized["dpo_reward_model"][0] == 0.0
    assert stack.normalizers["dpo_reward_model"].count == 2
    assert all(math.isfinite(r) for r in res.rewards)


def test_all_completions_failed(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    res = stack.score_step({**_step(["a", "b"]), "failed": [True, True]})
    assert res.rewards == [0.0, 0.0] and res.statuses == ["failed", "failed"]
    assert all(math.isnan(x) for x in res.raw["rlhf_reward_model"])
    assert res.normalized["rlhf_reward_model"] == [0.0, 0.0]
    assert stack.normalizers["rlhf_reward_model"].count == 0
    res = stack.score_step(_step([None, "ok text"]))
    assert res.statuses == ["failed", "ok"] and res.event["completions"][0] == ""


def test_scorer_exception_marks_error_not_crash(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    res = stack.score_step(_step(["RAISE", "fine"]))
    assert res.statuses == ["error", "error"]
    assert res.rewards == [0.0, 0.0]
    res = stack.score_step(_step(["OOM", "fine"]))
    assert res.statuses[0] == "oom" and res.rewards[0] == 0.0


def test_blacklist_tracks_best_within_forward_pass(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    q = stack.score_step(_step(["what is x?", "why is y?"], name="followup0")).best
    res = stack.score_step(_step([q, "another question?"], name="followup1"))
    assert res.normalized["blacklist_filter"] == [0.0, 1.0]
    res = stack.score_step(_step([q, "summary"], name="augment"))  # a new forward pass resets
    assert res.normalized["blacklist_filter"] == [1.0, 1.0]


def test_disabled_mask_logs_zeros_and_is_not_applied(tmp_path, fake_registry) -> None:  # noqa: ANN001
    cfg = from_dict({"state_dir": str(tmp_path), "models": {"nsfw_filter": {"enabled": False}}})
    res = RewardStack(cfg).score_step(_step(["good text", "fine text"]))
    assert res.event["nsfw_filter"] == [0.0, 0.0]
    assert any(r > 0 for r in res.rewards)


def test_a_stateful_mask_runs_its_stateless_part_against_the_validators_state(fake_config, monkeypatch) -> None:  # noqa: ANN001
    """The stack runs a stateful mask's forward pass only (`Scorer.stateless_part`); the history it
    feeds is the validator's state: saved, restored, and not the scorer's (its `score` raises)."""
    use_builder(monkeypatch, DIVERSITY, "fakes:build_embeddings")
    stack = RewardStack(fake_config)
    res = stack.score_step(_step(["one", None, "two", "three"]))
    assert res.model_statuses[DIVERSITY] == ["ok", "failed", "ok", "ok"]
    assert all(math.isfinite(x) for i, x in enumerate(res.raw[DIVERSITY]) if i != 1)
    stack.score_step(_step(["four", "five"]))
    assert stack.state.diversity.history.shape[0] == 5
    again = RewardStack(fake_config)
    assert torch.equal(again.state.diversity.history, stack.state.diversity.history)


def test_state_survives_restart(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    for i in range(3):
        stack.score_step(_step([f"text {i}", f"other {i}", "third"]))
    again = RewardStack(fake_config)
    assert again.normalizers == stack.normalizers
    assert again.steps_scored == 3


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"prompt": "p", "completions": []}, "name"),
        ({"name": "augment", "prompt": 3, "completions": []}, "prompt"),
        ({"name": "augment", "prompt": "p", "completions": "x"}, "completions"),
        ({"name": "augment", "prompt": "p", "completions": [1]}, "completions"),
        ({"name": "augment", "prompt": "p", "completions": ["a"], "uids": [1, 2]}, "uids"),
        ({"name": "augment", "prompt": "p", "completions": ["a"], "failed": [1]}, "failed"),
        ({"name": "augment", "prompt": "p", "completions": ["ok", "abc \ud800 def"]}, "completions[1]"),
        ({"name": "augment", "prompt": "\udfff", "completions": []}, "prompt"),
    ],
)
def test_bad_steps_name_the_field(obj: dict, field: str) -> None:
    with pytest.raises(InputError) as e:
        Step.from_dict(obj, line=7)
    assert e.value.field == field and "line 7" in str(e.value)


def test_state_of_a_switched_off_scorer_is_kept(fake_config, tmp_path, fake_registry) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    stack.store.save({"diversity_reward_model": {"history": [[1.0, 2.0]]}, "normalizers": {}})
    off = from_dict({"state_dir": fake_config.state_dir, "models": {"diversity_reward_model": {"enabled": False}}})
    again = RewardStack(off)
    again.score_step(_step(["one text", "two text"]))
    assert again.store.load()["diversity_reward_model"] == {"history": [[1.0, 2.0]]}


def test_non_finite_score_with_ok_status_becomes_error(fake_config, monkeypatch) -> None:  # noqa: ANN001
    import fakes

    real = fakes.FakeReward.score

    def leaky(self, request):  # noqa: ANN001, ANN202 - a model that returns inf but says ok
        res = real(self, request)
        res.scores = [math.inf if c == "INF" else x for c, x in zip(request.completions, res.scores)]
        return res

    monkeypatch.setattr(fakes.FakeReward, "score", leaky)
    stack = RewardStack(fake_config)
    res = stack.score_step(_step(["INF", "fine text", "more text"]))
    assert res.model_statuses["rlhf_reward_model"][0] == "error" and math.isnan(res.raw["rlhf_reward_model"][0])
    assert res.statuses[0] == "error" and all(math.isfinite(r) for r in res.rewards)
    assert stack.normalizers["rlhf_reward_model"].count == 2


def test_empty_best_is_blacklisted_like_the_reference(fake_config) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    stack.score_step(_step(["", ""], name="followup0"))
    res = stack.score_step(_step(["", "a question?"], name="followup1"))
    assert res.normalized["blacklist_filter"] == [0.0, 1.0]


def test_scorer_returning_the_wrong_length_is_an_error_not_a_crash(fake_config, monkeypatch) -> None:  # noqa: ANN001
    import fakes

    from rewardstack._scorers.base import ScoreResult

    monkeypatch.setattr(fakes.FakeMask, "score", lambda self, request: ScoreResult([1.0], ["ok"]))
    res = RewardStack(fake_config).score_step(_step(["one text", "two text", None]))
    assert res.model_statuses["nsfw_filter"] == ["error", "error", "failed"]
    assert res.rewards == [0.0, 0.0, 0.0]
