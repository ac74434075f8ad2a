"""rewardstack: score LLM completions with an ensemble of reward models inside a planned memory budget.

The public API is small:

    from rewardstack import RewardStack, load_config
    stack = RewardStack(load_config("stack.toml"))
    result = stack.score_step({"name": "augment", "prompt": "...", "completions": ["...", "..."]})
    result.rewards, result.best, result.statuses, result.event

Errors rewardstack raises on purpose derive from `RewardStackError` (see `rewardstack.errors`).
"""

from rewardstack.config import ModelConfig, StackConfig, default_config, load_config
from rewardstack.errors import ConfigError, InputError, ModelLoadError, RewardStackError, StateError
from rewardstack.stack import RewardStack, Step, StepResult

__version__ = "0.1.0"

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
