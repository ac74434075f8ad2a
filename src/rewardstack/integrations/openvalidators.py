"""The openvalidators drop-in (`rewardstack_client.openvalidators`), with an in-process backend too.

`OpenValidatorsStack.remote(client)` talks to the service; `OpenValidatorsStack.local(stack)`
scores with a `RewardStack` in the validator's own process (one GPU process: the validator's),
the same objects and semantics otherwise. The drop-in itself is documented where it lives.
"""

from __future__ import annotations

import json
from typing import Any

from rewardstack_client.openvalidators import (MASKS, REWARD_MODELS, Blacklist, DiversityState, RewardFunction,
                                               StepCallback)
from rewardstack_client.openvalidators import OpenValidatorsStack as _RemoteStack

from rewardstack._fileio import event_line


class OpenValidatorsStack(_RemoteStack):
    """`rewardstack_client.openvalidators.OpenValidatorsStack` plus the in-process backend."""

    @classmethod
    def local(cls, stack: Any, *, on_step: list[StepCallback] | None = None, wandb: Any = "auto") -> "OpenValidatorsStack":
        """Backed by an in-process `RewardStack` (its state is saved after every step)."""
        def score(step: dict[str, Any]) -> dict[str, Any]:
            event = json.loads(event_line(stack.score_step(step).event))
            event["sequence"] = stack.steps_scored  # as the service numbers its answers
            return event

        cfg = stack.config
        return cls(score, cfg.reward_weights(), [n for n in MASKS if cfg.models[n].active], on_step=on_step, wandb=wandb)


__all__ = ["Blacklist", "DiversityState", "MASKS", "OpenValidatorsStack", "REWARD_MODELS", "RewardFunction"]
