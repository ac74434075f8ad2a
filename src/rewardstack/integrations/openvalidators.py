"""A drop-in for the openvalidators validator's reward functions, backed by rewardstack.

The validator (openvalidators 1.x, `forward.py`'s `run_step`) holds `reward_functions` with
`reward_weights`, `masking_functions` and a `blacklist`, and for each step calls

    reward_i, reward_i_normalized = reward_fn_i.apply(prompt, responses, name)    # each model
    mask_i, mask_i_normalized = masking_fn_i.apply(base_prompt, responses, name)  # each mask

then combines them (`rewards += w * normalized`, `rewards *= mask`) and takes the argmax as best.
`OpenValidatorsStack` gives objects with that interface (`name`, `apply`, the blacklist's `reset`
and lists) so a validator swaps its stack in a few lines:

    rs = OpenValidatorsStack.local(RewardStack.from_config("stack.toml"))      # in process
    rs = OpenValidatorsStack.remote(Client("http://127.0.0.1:8000", namespace="me"))  # the service
    self.reward_functions, self.reward_weights = rs.reward_functions, rs.reward_weights
    self.masking_functions, self.blacklist = rs.masking_functions, rs.blacklist

The whole step is scored once, by the stack, at the first `apply` of a step (a new name, prompt or
set of completions); every function then returns its column of that one result. The first call
comes from a reward function, before the validator has passed the base prompt, so it is derived
the validator's way: for `augment` the prompt itself, for `followupN` the best of the forward
pass's augment step, for `answerN` the best of `followupN`. A mask called with another base prompt
raises (the step has been committed with the derived one). The stack records each step's best in
its blacklist itself; the lists the validator appends to are kept for its own use and not read.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

import torch

from rewardstack.config import MASKS, REWARD_MODELS
from rewardstack.models import BLACKLIST

ScoreFn = Callable[[dict[str, Any]], dict[str, Any]]
"""A step dict in, its event dict out (the `rewardstack score` event line's fields)."""


def _completion(response: Any) -> str | None:
    """A response's completion, stripped, or None for a failed call (bittensor's `is_success`)."""
    if isinstance(response, str):
        return response.strip()
    if response is None or not getattr(response, "is_success", True):
        return None
    return str(getattr(response, "completion", "")).strip()


def _value(x: Any) -> float:
    return math.nan if x is None else float(x)


class _Session:
    """The step being scored, the bests that give later steps their base prompt, and the backend."""

    def __init__(self, score: ScoreFn, weights: dict[str, float], active_masks: list[str]) -> None:
        self.score = score
        self.weights = weights
        self.active_masks = active_masks
        self.key: tuple | None = None
        self.event: dict[str, Any] | None = None
        self.base_prompt: str | None = None
        self.bests: dict[str, str] = {}
        self.new_pass = False

    def base_for(self, name: str, prompt: str) -> str:
        m = re.fullmatch(r"followup(\d+)", name)
        if m and "augment" in self.bests:
            return self.bests["augment"]
        m = re.fullmatch(r"answer(\d+)", name)
        if m and f"followup{m.group(1)}" in self.bests:
            return self.bests[f"followup{m.group(1)}"]
        return prompt

    def event_for(self, prompt: str, responses: Sequence[Any], name: str, *, base_prompt: str | None) -> dict[str, Any]:
        completions = [_completion(r) for r in responses]
        key = (name, tuple(completions))
        if self.key == key and self.event is not None:
            if base_prompt is not None and base_prompt != self.base_prompt:
                raise ValueError(f"step '{name}' was scored with base prompt {self.base_prompt!r} (the validator's "
                                 f"rule) but a mask got {base_prompt!r}; pass it before the first reward call")
            return self.event
        if name == "augment":
            self.bests = {}
        base = base_prompt if base_prompt is not None else self.base_for(name, prompt)
        step: dict[str, Any] = {"name": name, "prompt": prompt, "completions": completions, "base_prompt": base}
        if self.new_pass:
            step["new_forward_pass"] = True
            self.new_pass = False
        self.event = self.score(step)
        self.key, self.base_prompt = key, base
        self.bests[name] = self.event["best"]
        return self.event


class RewardFunction:
    """One reward model or mask, with openvalidators' `BaseRewardModel.apply` interface."""

    def __init__(self, session: _Session, name: str, *, mask: bool) -> None:
        self._session = session
        self._name = name
        self.mask = mask

    @property
    def name(self) -> str:
        """The event name (`rlhf_reward_model`, `blacklist_filter`, ...)."""
        return self._name

    def apply(self, prompt: str, responses: Sequence[Any], name: str) -> tuple[torch.FloatTensor, torch.FloatTensor]:
        """(raw, normalized) float32 tensors, one value per response; failed ones NaN and 0."""
        event = self._session.event_for(prompt, responses, name, base_prompt=prompt if self.mask else None)
        raw = torch.tensor([_value(x) for x in event[self._name]], dtype=torch.float32)
        normalized = torch.tensor([_value(x) for x in event[self._name + "_normalized"]], dtype=torch.float32)
        return raw, normalized


class Blacklist(RewardFunction):
    """The blacklist mask; `reset()` opens a new forward pass (the validator calls it per pass)."""

    def __init__(self, session: _Session) -> None:
        super().__init__(session, BLACKLIST.name, mask=True)
        self.question_blacklist: list[str] = []
        self.answer_blacklist: list[str] = []

    def reset(self) -> None:
        """Start a new forward pass: the stack forgets this pass's best questions and answers."""
        self.question_blacklist = []
        self.answer_blacklist = []
        self._session.new_pass = True


class OpenValidatorsStack:
    """The validator-facing set: `reward_functions`, `reward_weights`, `masking_functions`, `blacklist`."""

    def __init__(self, score: ScoreFn, weights: dict[str, float], active_masks: list[str]) -> None:
        self._session = _Session(score, weights, active_masks)
        self.reward_functions = [RewardFunction(self._session, n, mask=False) for n in REWARD_MODELS if weights.get(n, 0) > 0]
        self.reward_weights = [weights[f.name] for f in self.reward_functions]
        self.blacklist = Blacklist(self._session)
        self.masking_functions: list[RewardFunction] = [
            self.blacklist if n == BLACKLIST.name else RewardFunction(self._session, n, mask=True)
            for n in MASKS if n in active_masks
        ]

    @classmethod
    def local(cls, stack: Any) -> "OpenValidatorsStack":
        """Backed by an in-process `RewardStack` (its state is saved after every step)."""
        from rewardstack.fileio import event_line
        import json

        def score(step: dict[str, Any]) -> dict[str, Any]:
            return json.loads(event_line(stack.score_step(step).event))

        cfg = stack.config
        return cls(score, cfg.reward_weights(), [n for n in MASKS if cfg.models[n].active])

    @classmethod
    def remote(cls, client: Any) -> "OpenValidatorsStack":
        """Backed by the scoring service through a `rewardstack.client.Client`."""
        info = client.stack()
        weights = {m["name"]: m["weight"] for m in info["models"] if m["kind"] == "reward"}
        masks = [m["name"] for m in info["models"] if m["kind"] == "mask"]
        return cls(client.score, weights, masks)


__all__ = ["Blacklist", "OpenValidatorsStack", "RewardFunction"]
