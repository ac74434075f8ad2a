"""rewardstack: score LLM completions with an ensemble of reward models inside a planned memory budget.

The public API is small:

    from rewardstack import RewardStack, load_config
    stack = RewardStack(load_config("stack.toml"))
    result = stack.score_step({"name": "augment", "prompt": "...", "completions": ["...", "..."]})
    result.rewards, result.best, result.statuses, result.event

Errors rewardstack raises on purpose derive from `RewardStackError` (see `rewardstack.errors`).

The names below load on first use (module `__getattr__`): `import rewardstack` and the command
line's `--help` import no torch; `from rewardstack import RewardStack` imports the stack then.

Importing the package asks MKL for its strict reproducibility mode (`rewardstack._reproducible`):
the same input gets the same score whatever is batched with it (docs/TRAINERS.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rewardstack._reproducible import request_strict

request_strict()  # MKL reads MKL_CBWR at its first call: set before anything here imports torch

from rewardstack.errors import ConfigError, InputError, ModelLoadError, RewardStackError, StateError
from rewardstack._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig, StackConfig, default_config, load_config
    from rewardstack.stack import RewardStack, Step, StepResult

__version__ = "0.1.0"

_LAZY = (dict.fromkeys(["ModelConfig", "StackConfig", "default_config", "load_config"], "rewardstack.config")
         | dict.fromkeys(["RewardStack", "Step", "StepResult"], "rewardstack.stack"))

__all__ = [
    "ConfigError",
    "InputError",
    "ModelConfig",
    "ModelLoadError",
    "RewardStack",
    "RewardStackError",
    "StackConfig",
    "StateError",
    "Step",
    "StepResult",
    "default_config",
    "load_config",
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
