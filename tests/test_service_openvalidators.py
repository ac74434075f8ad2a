"""The openvalidators drop-in, driven the way the validator's forward pass drives its reward stack.

augment, then followupN / answerN with the validator's base prompts, its float32 combination
(`rewards += w * normalized`, `rewards *= mask`), argmax for the best, and its blacklist calls;
the rewards must be the stack's for the same steps. The remote backend is tested against the real
server in test_service_api.py with the same driver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rewardstack._fileio import event_line
from rewardstack.config import load_config
from rewardstack.integrations.openvalidators import OpenValidatorsStack
from rewardstack.stack import RewardStack

from service_fixtures import write_config


@dataclass
class Response:
    """What the validator's dendrite returns per miner (bittensor's call object, reduced)."""

    completion: str
    is_success: bool = True


def _completions(tag: str, k: int, kind: str) -> list[Response]:
    out = [Response(f"  {tag} {kind} {k} answer {j}: " + " ".join(f"t{(k + j * 5 + i) % 17}" for i in range(2 + j)) + "  ")
           for j in range(5)]
    out[3] = Response("", is_success=False)  # a failed call
    if kind == "answer":
        out[4] = Response("That is an excellent question.")
    return out


def drive_validator(rs: OpenValidatorsStack, *, tag: str, passes: int = 2, followups: int = 2) -> tuple[list[list[float]], list[dict]]:
    """The validator's forward passes over `rs`; (its rewards per step, the steps as the stack sees them)."""
    rewards_seen: list[list[float]] = []
    steps: list[dict[str, Any]] = []

    def run_step(prompt: str, name: str, responses: list[Response], base_prompt: str | None = None) -> str:
        if base_prompt is None:
            base_prompt = prompt
        rewards = torch.zeros(len(responses), dtype=torch.float32)
        for weight, fn in zip(rs.reward_weights, rs.reward_functions):
            raw, normalized = fn.apply(prompt, responses, name)
            assert raw.dtype == torch.float32 and raw.shape == (len(responses),)
            rewards += weight * normalized
        for fn in rs.masking_functions:
            mask, mask_normalized = fn.apply(base_prompt, responses, name)
            rewards *= mask_normalized
        completions = [r.completion for r in responses]
        best = completions[rewards.argmax(dim=0)].strip()
        rewards_seen.append(rewards.tolist())
        steps.append({"name": name, "prompt": prompt, "base_prompt": base_prompt,
                      "completions": [r.completion if r.is_success else None for r in responses]})
        return best

    for p in range(passes):
        rs.blacklist.reset()
        base = run_step(f"{tag} pass {p}: summarize the text.", "augment", _completions(tag, p, "summary"))
        for k in range(followups):
            question = run_step(f"{tag} ask about: {base}", f"followup{k}", _completions(tag, p * 10 + k, "question"), base_prompt=base)
            answer = run_step(f"{tag} answer: {question}", f"answer{k}", _completions(tag, p * 10 + k, "answer"), base_prompt=question)
            rs.blacklist.question_blacklist.append(question)
            rs.blacklist.answer_blacklist.append(answer)
    return rewards_seen, steps


def expected_rewards(stack: RewardStack, steps: list[dict]) -> list[list[float]]:
    """The stack's rewards for the same steps, scored in order against a fresh state, in float32."""
    state = stack.new_state()
    out = []
    for s in steps:
        event = json.loads(event_line(state.apply(stack.forward(s)).event))
        out.append(torch.tensor(event["rewards"], dtype=torch.float32).tolist())
    return out


def close(got: list[list[float]], want: list[list[float]]) -> bool:
    return len(got) == len(want) and all(
        torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-7) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def stack_config(standins: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(standins, tmp_path_factory.mktemp("ov") / "state", "ov-local")


def test_local_dropin_gives_the_stacks_rewards(stack_config: Path) -> None:
    stack = RewardStack(load_config(stack_config), load_state=False)
    got, steps = drive_validator(OpenValidatorsStack.local(stack), tag="ov-local")
    want = expected_rewards(stack, steps)  # a fresh state; the forward passes hold none
    assert close(got, want), (got, want)
    # The validator's steps had the validator's base prompts, and the blacklist did mask something.
    assert steps[1]["base_prompt"] == steps[0]["completions"][int(torch.tensor(got[0]).argmax())].strip()
    assert any(r == 0.0 for rewards in got[2::5] for r in rewards)
    names = [f.name for f in OpenValidatorsStack.local(stack).masking_functions]
    assert names[0] == "blacklist_filter" and "diversity_reward_model" in names


def test_a_mask_with_another_base_prompt_is_refused(stack_config: Path) -> None:
    stack = RewardStack(load_config(stack_config), load_state=False)
    rs = OpenValidatorsStack.local(stack)
    responses = [Response("one reply"), Response("two replies")]
    rs.reward_functions[0].apply("a prompt", responses, "augment")
    with pytest.raises(ValueError, match="base prompt"):
        rs.masking_functions[0].apply("some other base prompt", responses, "augment")
