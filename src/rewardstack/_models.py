"""The model registry: one declaration per model of the stack, read by everything that names models.

Each `ModelSpec` says, for one of the spec's event names: whether it is a weighted reward model or
a mask, its family, its default checkpoint(s), dtype and revision (the openvalidators 1.2.0
default stack), the options its table accepts (`rewardstack._modeloptions`), the function that
builds its scorer and the one that writes its offline stand-in, and what the full-size simulation
runs for it (the family's pass, the transformers class, its length bound without a tokenizer).
Config defaults and validation, `config --explain`, the scorer lookup, the stand-ins, `plan`, the
simulation and replay all read this table; no other library module spells a model's event name
(tests/test_registry.py checks it).

Builders are "module:function" strings, imported on first use: a stack without the judge never
imports its code, and this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._modeloptions import ModelOptions
    from rewardstack._settings import Table

DTYPES = ("float32", "float16", "bfloat16")
"""Weight dtypes a model may be loaded in (a model's `dtype` key)."""

@dataclass(frozen=True)
class Simulated:
    """What the full-size simulation (`rewardstack._planning.simulate`) runs for one checkpoint."""

    family: str
    """The pass: `classifier`, `encoder`, `reciprocate`, `dahoas`, `dpo` or `judge`."""
    auto_class: str
    """The transformers class the model is built with on the meta device."""
    head: str | None = None
    """Encoders: the scorer's "module:function" that reads a value from the outputs."""

@dataclass(frozen=True)
class ModelSpec:
    """One model of the stack, declared once."""

    name: str
    """The spec's event name, e.g. `rlhf_reward_model`; the `[models.<name>]` table."""
    kind: str
    """`reward` (weighted) or `mask`."""
    family: str
    """The scorer family (`rewardstack._scorers.<family>`)."""
    defaults: Mapping[str, Any]
    """The config's defaults for this model: the openvalidators 1.2.0 default stack."""
    options: str
    """The class of the scorer's own options in `rewardstack._modeloptions`, by name (`options_class`)."""
    builder: str
    """"module:function" `(ModelConfig, Runtime) -> Scorer`."""
    standin: str | None = None
    """"module:function" `(folder) -> config entry` that writes a small random model (None: rules)."""
    checkpoints: int = 1
    """How many checkpoints the model runs (2: the relevance filter, which takes `paths`)."""
    simulated: Simulated | None = None
    """The simulated pass of each checkpoint (None: no weights)."""
    tokenizer_length: int | None = None
    """The length bound the published tokenizer declares (the simulation's stand-in for it)."""
    pair_input: bool = False
    """Scores the (prompt, completion) pair as two segments rather than their concatenation."""
    reference_dtype: str | None = None
    """The dtype the reference loads it in when that is not the configured one (it passed none)."""
    reference_unbounded: bool = False
    """The reference did not truncate its input (OpenAssistant: the seed report's OOM)."""
    modelled: tuple[str, ...] = ()
    """What the simulation models rather than runs (said in its results)."""
    embeds_with: str | None = None
    """The run whose embeddings this model reuses (one checkpoint, one pass per step)."""

    @property
    def is_reward(self) -> bool:
        """Whether this is a weighted reward model (as opposed to a mask)."""
        return self.kind == "reward"

    @property
    def is_rule(self) -> bool:
        """Whether it is rule-based (no weights, no checkpoint)."""
        return self.simulated is None

    def runs(self) -> list[str]:
        """The names of its model runs: `name`, or `name[k]` for each of several checkpoints."""
        return [self.name] if self.checkpoints == 1 else [f"{self.name}[{k}]" for k in range(self.checkpoints)]

_CLS = "AutoModelForSequenceClassification"

DPO = ModelSpec(
    "dpo_reward_model", "reward", "dpo",
    # BTLM is not a transformers architecture: it loads only with its own (hub) modeling code, which
    # runs only from a commit locked by `rewardstack download`. No other default model needs code.
    {"path": "cerebras/btlm-3b-8k-base", "weight": 0.3, "dtype": "float16", "trust_remote_code": True},
    "DpoOptions", "rewardstack._scorers.dpo:build", "rewardstack._standins.families:make_dpo_standin",
    simulated=Simulated("dpo", "AutoModelForCausalLM"),
    modelled=("penalty bookkeeping (columns bounded: every scored token distinct)",),
)

OPENASSISTANT = ModelSpec(
    "rlhf_reward_model", "reward", "classifier",
    {"path": "OpenAssistant/reward-model-deberta-v3-large-v2", "weight": 0.4, "dtype": "float32"},
    "ClassifierOptions", "rewardstack._scorers.classifier:build_openassistant",
    "rewardstack._standins.families:make_openassistant_standin",
    simulated=Simulated("classifier", _CLS, "rewardstack._scorers.classifier:first_logit"),
    tokenizer_length=512, pair_input=True, reference_dtype="float32", reference_unbounded=True,
)

RECIPROCATE = ModelSpec(
    "reciprocate_reward_model", "reward", "reciprocate",
    {"path": "reciprocate/gpt-j_rm_format-oa", "revision": "501f895", "weight": 0.3, "dtype": "float16"},
    "ReciprocateOptions", "rewardstack._scorers.reciprocate:build", "rewardstack._standins.families:make_reciprocate_standin",
    simulated=Simulated("reciprocate", _CLS),
)

DAHOAS = ModelSpec(
    "dahoas_reward_model", "reward", "dahoas",
    {"path": "Dahoas/gptj-rm-static", "weight": 0.0, "dtype": "float16"},
    "DahoasOptions", "rewardstack._scorers.dahoas:build", "rewardstack._standins.families:make_dahoas_standin",
    simulated=Simulated("dahoas", "GPTJModel"),
)

JUDGE = ModelSpec(
    "prompt_reward_model", "reward", "judge",
    {"path": "VMware/open-llama-7b-open-instruct", "weight": 0.0, "dtype": "float16"},
    "JudgeOptions", "rewardstack._scorers.judge:build", "rewardstack._standins.families:make_judge_standin",
    simulated=Simulated("judge", "AutoModelForCausalLM"),
    modelled=("generation (prefill with logits_to_keep=1, then one decode step per new token)",),
)

BLACKLIST = ModelSpec(
    "blacklist_filter", "mask", "rules", {"enabled": True}, "NoOptions",
    "rewardstack._scorers.rules:build_blacklist",
)

TASK_VALIDATOR = ModelSpec(
    "task_validator_filter", "mask", "rules", {"enabled": True}, "NoOptions",
    "rewardstack._scorers.rules:build_task_validator",
)

RELEVANCE = ModelSpec(
    "relevance_filter", "mask", "embedding",
    {"paths": ["bert-base-uncased", "sentence-transformers/all-mpnet-base-v2"], "enabled": True, "dtype": "float32"},
    "RelevanceOptions", "rewardstack._scorers.embedding:build_relevance",
    "rewardstack._standins.families:make_relevance_standin", checkpoints=2,
    simulated=Simulated("encoder", "AutoModel", "rewardstack._scorers.embedding:pooled"),
)

DIVERSITY = ModelSpec(
    "diversity_reward_model", "mask", "embedding",
    {"path": "sentence-transformers/all-mpnet-base-v2", "enabled": True, "dtype": "float32"},
    "EmbeddingOptions", "rewardstack._scorers.embedding:build_diversity",
    "rewardstack._standins.families:make_diversity_standin",
    simulated=Simulated("encoder", "AutoModel", "rewardstack._scorers.embedding:pooled"),
    embeds_with="relevance_filter[1]",
)

NSFW = ModelSpec(
    "nsfw_filter", "mask", "classifier",
    {"path": "facebook/roberta-hate-speech-dynabench-r4-target", "enabled": True, "dtype": "float32"},
    "ClassifierOptions", "rewardstack._scorers.classifier:build_nsfw", "rewardstack._standins.families:make_nsfw_standin",
    simulated=Simulated("classifier", _CLS, "rewardstack._scorers.classifier:hate_value"),
    tokenizer_length=512,
)

MODELS: tuple[ModelSpec, ...] = (DPO, OPENASSISTANT, RECIPROCATE, DAHOAS, JUDGE, BLACKLIST, TASK_VALIDATOR, RELEVANCE,
                                 DIVERSITY, NSFW)
"""Every model, in the spec's order (reward models, then masks)."""
BY_NAME: dict[str, ModelSpec] = {m.name: m for m in MODELS}
REWARD_MODELS: tuple[str, ...] = tuple(m.name for m in MODELS if m.is_reward)
"""The weighted reward models, in the spec's order."""
MASKS: tuple[str, ...] = tuple(m.name for m in MODELS if not m.is_reward)
"""The masks, in the spec's order."""
ALL_MODELS: tuple[str, ...] = REWARD_MODELS + MASKS
RULE_MASKS: tuple[str, ...] = tuple(m.name for m in MODELS if m.is_rule)
"""Masks without weights (no checkpoint to load)."""

USER_PREFIX = "rewards."
"""User-named reward models (`[rewards.<name>]` tables) run as `rewards.<name>`: a dot no event name has,
so a user's model can never take one of the ten names above, and lookups need no registration."""

HF_REWARD = ModelSpec(
    USER_PREFIX + "*", "reward", "hf_reward", {"dtype": "float32"}, "HfRewardOptions",
    "rewardstack._scorers.hfreward:build",
    simulated=Simulated("classifier", _CLS, "rewardstack._scorers.classifier:first_logit"),
)
"""The declaration every user-named HuggingFace sequence-classification reward model shares."""


def is_user_model(name: str) -> bool:
    """Whether `name` (or the run name `name[...]`) is a user-named reward model (`rewards.<name>`)."""
    return name.startswith(USER_PREFIX)


def owner_of(name: str) -> str:
    """The model a run or calibration name belongs to: `relevance_filter[1]` (one of a model's
    checkpoints) and `dpo_reward_model[chunk=64]` (a profile of one setting) both name their model
    before the bracket; a plain model name is its own owner."""
    return name.split("[", 1)[0]


def checkpoint_index(run: str) -> int:
    """Which of its model's checkpoints (`paths`) a run `name[k]` runs: k (`runs` gives the names)."""
    return int(run[len(owner_of(run)):].strip("[]"))


def spec(name: str) -> ModelSpec:
    """The declaration of model `name` (a run name such as `relevance_filter[1]` names its model)."""
    owner = owner_of(name)
    if is_user_model(owner):
        return dataclasses.replace(HF_REWARD, name=owner)
    try:
        return BY_NAME[owner]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; expected one of: {', '.join(ALL_MODELS)}") from None

def resolve(ref: str) -> Callable[..., Any]:
    """The function a "module:function" reference names (imported now)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)

# -- options ---------------------------------------------------------------------------------------

def options_class(model: str) -> type[Table]:
    """The options model of `model` (`ModelSpec.options`, imported now: pydantic stays out of
    `rewardstack --help`); `NoOptions` for a name the registry does not know (a test's own scorer,
    configured in code)."""
    known = is_user_model(model) or owner_of(model) in BY_NAME
    return getattr(importlib.import_module("rewardstack._modeloptions"), spec(model).options if known else "NoOptions")

def option_keys(model: str) -> set[str]:
    """The option keys model `model` accepts."""
    return set(options_class(model).model_fields)

def parse_options(model: str, raw: Mapping[str, Any]) -> ModelOptions:
    """Validate the options set for `model` (types, checks) into its options model, every key
    left out at its declared default: what `ModelConfig.options` holds."""
    from rewardstack._settings import parse_table

    return parse_table(options_class(model), dict(raw), model if is_user_model(model) else f"models.{model}")
