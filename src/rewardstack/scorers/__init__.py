"""The scorers: one module per family, each registering its builders and its offline stand-ins.

`REGISTRY` maps each event name of the spec to "module:builder" (a function
`(ModelConfig, Runtime) -> Scorer`) and, for model-backed scorers, "module:standin" (a function
`(Path) -> dict` that writes a small random model of the right family into a folder and returns the
config entry, relative to that folder's parent, that loads it). Modules are imported lazily so that
a stack without, say, the judge never imports its code.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig
    from rewardstack.scorers.base import Runtime, Scorer

REGISTRY: dict[str, tuple[str, str | None]] = {
    "dpo_reward_model": ("rewardstack.scorers.dpo:build", "rewardstack.scorers.dpo:make_standin"),
    "rlhf_reward_model": ("rewardstack.scorers.classifier:build_openassistant", "rewardstack.scorers.classifier:make_openassistant_standin"),
    "reciprocate_reward_model": ("rewardstack.scorers.reciprocate:build", "rewardstack.scorers.reciprocate:make_standin"),
    "dahoas_reward_model": ("rewardstack.scorers.dahoas:build", "rewardstack.scorers.dahoas:make_standin"),
    "prompt_reward_model": ("rewardstack.scorers.judge:build", "rewardstack.scorers.judge:make_standin"),
    "blacklist_filter": ("rewardstack.scorers.rules:build_blacklist", None),
    "task_validator_filter": ("rewardstack.scorers.rules:build_task_validator", None),
    "relevance_filter": ("rewardstack.scorers.embedding:build_relevance", "rewardstack.scorers.embedding:make_relevance_standin"),
    "diversity_reward_model": ("rewardstack.scorers.embedding:build_diversity", "rewardstack.scorers.embedding:make_diversity_standin"),
    "nsfw_filter": ("rewardstack.scorers.classifier:build_nsfw", "rewardstack.scorers.classifier:make_nsfw_standin"),
}


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_scorer(cfg: "ModelConfig", runtime: "Runtime") -> "Scorer":
    """Build the scorer for one configured model."""
    return _resolve(REGISTRY[cfg.name][0])(cfg, runtime)


def standin_builder(name: str) -> Callable[[Path], dict[str, Any]] | None:
    """The stand-in maker of a model-backed scorer (None for rule masks)."""
    ref = REGISTRY[name][1]
    return _resolve(ref) if ref else None
