"""The scorer-specific keys each `[models.*]` table accepts, declared: type, default, one line of help.

A model table takes the keys every model has (`ModelConfig`: path, weight, dtype, ...) and the
options of its scorer, declared here as one `Table` (a pydantic model) per family (the model registry,
`rewardstack._models`, says which model takes which, and validates them: `parse_options`); the docstring
under each field is the help that `rewardstack config --explain` prints. `config.py` rejects any other key, naming the
closest valid one. Options are written flat in the model's table:

    [models.dpo_reward_model]
    path = "cerebras/btlm-3b-8k-base"
    logits_chunk = 256

`ModelConfig.options` holds the model's options, every field filled: a scorer, `plan` and the
simulation read `cfg.options.<key>`, so each default is written once, here (`tests/test_config_strict.py`
checks that nothing reads an option with a fallback of its own).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rewardstack._settings import Table


class DpoOptions(Table):
    """DPO (`dpo_reward_model`)."""

    logits_chunk: int = Field(512, gt=0)
    """Most rows of [rows, vocabulary] float32 logits held at once (bounds memory; numbers do not change)."""
    tune_logits_chunk: bool = True
    """Measure the fastest chunk up to logits_chunk at load (false: use logits_chunk as is)."""
    shared_prefix: bool = True
    """Run the step's common token prefix once through a KV cache when the load probe finds the model takes cache objects (false: full sequences)."""
    attention: Literal["blocked", "own"] = "blocked"
    """"blocked": a model whose own attention builds [heads, L, L] scores (BTLM's ALiBi) runs it exactly in blocks of query rows, when a load-time probe agrees with its own; "own": the model's code as is."""
    attention_block: int = Field(512, gt=0)
    """Query rows per attention block (the budget may halve it; numbers do not change)."""
    max_batch: int = Field(16, gt=0)
    """Most sequences per forward pass (batch_size, when set, takes precedence)."""
    calibration_length: int | None = Field(None, gt=0)
    """Longest input, in tokens, of the load-time profile runs that fit the cost model; the planner admits nothing longer (default: the model's length bound)."""


class ClassifierOptions(Table):
    """Sequence classifiers (`rlhf_reward_model`, `nsfw_filter`)."""

    max_batch_tokens: int | None = Field(None, gt=0)
    """Most tokens per forward pass (unset: a device-dependent default)."""


class ReciprocateOptions(Table):
    """Reciprocate (`reciprocate_reward_model`)."""

    shared_prefix: bool = True
    """Run the step's common token prefix once through a KV cache when the load probe finds the model takes cache objects (false: full sequences)."""
    max_batch: int = Field(16, gt=0)
    """Most sequences per forward pass (batch_size, when set, takes precedence)."""
    calibration_length: int | None = Field(None, gt=0)
    """Longest input, in tokens, of the load-time profile runs that fit the cost model; the planner admits nothing longer (default: the model's length bound)."""


class DahoasOptions(Table):
    """Dahoas (`dahoas_reward_model`)."""

    base_config: str = "EleutherAI/gpt-j-6b"
    """Hub id or folder of the GPT-J config and tokenizer, used when the checkpoint folder lacks them (the published .pt layout)."""
    shared_prefix: bool = True
    """Run each group's common token prefix once through a KV cache when the load probe finds the model takes cache objects (false: full sequences)."""
    max_batch: int = Field(16, gt=0)
    """Most sequences per forward pass (batch_size, when set, takes precedence)."""
    calibration_length: int | None = Field(None, gt=0)
    """Longest input, in tokens, of the load-time profile runs that fit the cost model; the planner admits nothing longer (default: the model's length bound)."""


class JudgeOptions(Table):
    """Prompt-based judge (`prompt_reward_model`)."""

    max_input: int = Field(2048, gt=0)
    """Cap on the model's input bound, in tokens (the filled template plus 2 generated tokens)."""
    kv_cache: bool = True
    """Generate through transformers' cache when the load probe finds the model takes cache objects (false: recompute the whole sequence per new token)."""
    max_batch: int = Field(16, gt=0)
    """Most sequences per generate call (batch_size, when set, takes precedence)."""
    calibration_length: int = Field(512, gt=0)
    """Longest input, in tokens, of the load-time profile runs that fit the cost model."""


class RelevanceOptions(Table):
    """Relevance filter (`relevance_filter`)."""

    bounds: list[float] = Field([-0.0246, 0.3], min_length=2, max_length=2)
    """The two similarity thresholds (model 1, model 2) a completion must exceed to pass."""
    max_batch_tokens: int | None = Field(None, gt=0)
    """Most tokens per forward pass (unset: a device-dependent default)."""


class EmbeddingOptions(Table):
    """Diversity (`diversity_reward_model`)."""

    max_batch_tokens: int | None = Field(None, gt=0)
    """Most tokens per forward pass (unset: a device-dependent default)."""


class HfRewardOptions(Table):
    """A user-named HuggingFace sequence-classification reward model (a `[rewards.<name>]` table)."""

    truncation_side: Literal["left", "right"] = "right"
    """Which end of an input past the length bound is cut: "right" keeps the start, "left" keeps the end (the response)."""
    chat_template: bool = True
    """Render `messages` inputs with the tokenizer's chat template (false: the model takes plain text only, and `messages` are refused)."""
    max_batch_tokens: int | None = Field(None, gt=0)
    """Most tokens per forward pass (unset: a device-dependent default)."""
    fixed_shapes: Literal["auto", "on", "off"] = "auto"
    """Passes of a fixed number of rows per width, filler rows added, so a text's score never depends on its company: "auto" turns them on where the start-up check finds it does on this hardware, "on" always, "off" never (the check then only warns); docs/TRAINERS.md gives the cost."""


class NoOptions(Table):
    """Rule masks: no options."""


ModelOptions = HfRewardOptions | DpoOptions | ClassifierOptions | ReciprocateOptions | DahoasOptions | JudgeOptions | RelevanceOptions | EmbeddingOptions | NoOptions
"""What `ModelConfig.options` holds: the options its model declares (`ModelSpec.options`)."""
