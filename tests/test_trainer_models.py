"""User-named HF reward models (`[rewards.<name>]`): config, plan, and the lane's batching, in process.

The batch-invariance test pins what docs/TRAINERS.md promises on CPU: an input's score is the
same, bit for bit, whatever the batch holds beside it (padding to a width of its own length,
`scorers.hfreward.pad_width`); padding each pass to its longest row instead fails it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rewardstack.config import from_dict, load_config
from rewardstack.errors import ConfigError
from rewardstack._scorers.hfreward import pad_width
from rewardstack._service.batching import prepare_job, score_now
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_rm(tmp_path_factory.mktemp("hfrm") / "rm")


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rewardstack.stack import RewardStack

    return RewardStack(load_config(rewards_config(tmp_path_factory.mktemp("cfg"), model)), load_state=False)


def _score(stack: Any, *groups: list[str]) -> list[list[float]]:
    """Score each group of texts as one request, all requests in one batch; the rewards per request."""
    jobs = [prepare_job(stack, g, [f"query[{i}]" for i in range(len(g))], ["rewards.tiny"], time.monotonic() + 60) for g in groups]
    score_now(stack, jobs)
    return [j.future.result(timeout=0).scores["rewards.tiny"] for j in jobs]


def test_same_input_same_score_whatever_it_is_batched_with(stack: Any, model: Path) -> None:
    target = texts(1, seed=3)[0]
    [[alone]] = _score(stack, [target])
    company = texts(40, seed=4)
    short = [t for t in company if len(t) < len(target)][:5]
    long = [t for t in company if len(t) > len(target)][:5]
    scorer = stack.scorers["rewards.tiny"]
    n = lambda t: len(scorer.encode(t, "q")[0])  # noqa: E731
    # Longer inputs that share the target's padded width (and so its passes): the company that
    # padding to a pass's longest row would change it by.
    beside = [t for t in texts(200, seed=6) if n(t) > n(target) and pad_width(n(t), 256) == pad_width(n(target), 256)]
    assert beside
    for groups in ([short, [target]], [[target], long], [company[:20], [target], company[20:]], [short + [target] + long],
                   [[target], beside[:1]], [beside[:3], [target]]):
        flat = [x for g in _score(stack, *groups) for x in g]
        where = [x for g in groups for x in g].index(target)
        assert flat[where] == alone, groups  # bit for bit
    [want] = reference_scores(model, [target])
    assert abs(alone - want) < 1e-5


def test_identical_inputs_are_scored_once_across_requests(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    scorer = stack.scorers["rewards.tiny"]
    seen: list[int] = []  # the rows of each run the memory layer plans
    memory = scorer.runtime.memory
    real = memory.run
    monkeypatch.setattr(memory, "run", lambda name, lengths, *a, **k: (seen.append(len(lengths)), real(name, lengths, *a, **k))[1])
    a, b = texts(2, seed=9)
    out = _score(stack, [a, b], [b], [a, a])
    assert seen == [2]
    assert out[1][0] == out[0][1] and out[2] == [out[0][0]] * 2


def test_rewards_table_config(model: Path, tmp_path: Path) -> None:
    cfg = load_config(rewards_config(tmp_path, model, extra="dtype = \"bfloat16\"\nmax_length = 32\nweight = 2.0"))
    [m] = cfg.active_models()  # a [rewards] table without [models]: the openvalidators models are off
    assert (m.name, m.dtype, m.max_length, m.weight, m.options.truncation_side) == ("rewards.tiny", "bfloat16", 32, 2.0, "right")
    both = from_dict({"models": {}, "rewards": {"rm": {"path": str(model)}}})
    assert "rlhf_reward_model" in [x.name for x in both.active_models()]  # with [models], the default stack stays
    assert from_dict({}).user_rewards() == []  # the openvalidators stack stays the default
    for raw, field in [({"rm": {"path": "org/rm"}}, "rewards.rm.revision"),  # a hub id needs a locked revision
                       ({"rm": {}}, "rewards.rm.path"),
                       ({"rm": {"path": str(model), "truncation_side": "middle"}}, "rewards.rm.truncation_side"),
                       ({"rm": {"path": str(model), "tokens": 3}}, "rewards.rm.tokens"),
                       ({"bad.name": {"path": str(model)}}, "rewards.bad.name")]:
        with pytest.raises(ConfigError) as e:
            from_dict({"rewards": raw})
        assert e.value.key == field, e.value
    assert from_dict({"rewards": {"rm": {"path": "org/rm", "revision": "0123abc"}}}).models["rewards.rm"].revision


def test_plan_covers_a_user_named_model_on_the_meta_device(model: Path, tmp_path: Path) -> None:
    config = rewards_config(tmp_path, model)
    r = subprocess.run([sys.executable, "-m", "rewardstack.cli", "plan", "--config", str(config), "--device-memory",
                        "40GiB"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("rewards.tiny"))
    assert "float32" in row and " 256 " in row  # its dtype and its length bound, from its config alone
