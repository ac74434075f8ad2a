"""TOML config -> validated pydantic models (`rewardstack._settings.Table`). Every error names the key it is about.

Layout (keys of `[models.*]` are the spec's event names):

    device = "cuda:0"
    state_dir = "state"

    [models.dpo_reward_model]
    path = "cerebras/btlm-3b-8k-base"
    weight = 0.3
    dtype = "float16"

    [models.relevance_filter]
    paths = ["bert-base-uncased", "sentence-transformers/all-mpnet-base-v2"]
    enabled = true

A model left out of the file takes its default; `weight = 0` or `enabled = false` turns it off.

Any HuggingFace sequence-classification reward model can join the stack under a name of the
user's own, in a `[rewards.<name>]` table (path, revision, dtype, max_length, batch_size,
trust_remote_code, weight, and the `HfRewardOptions`); it runs as `rewards.<name>` (never one of
the ten event names), scored by the trainer routes only. A config with `[rewards.*]` tables and no
`[models]` table runs those models alone: the openvalidators models are then all off.
Relative local paths are resolved against the config file's folder. A config that states no
`state_dir` keeps its state in its own folder of rewardstack's home (`rewardstack._paths`:
`$REWARDSTACK_HOME/<stem>-<hash>/state`), not in whatever folder the command runs from.

`build_config` is the one place a command's model flags (`--reward-model PATH_OR_HUB_ID@REV`,
`--dtype`, `--max-length`, ...) become `[rewards.<name>]` tables, alone or over a file's.
"""

from __future__ import annotations

import copy
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import Field, model_validator

from rewardstack import _paths as paths
from rewardstack.errors import ConfigError
from rewardstack._lockfile import is_hub_id, lock_path, read_lock
from rewardstack._modeloptions import ModelOptions, NoOptions
from rewardstack._models import (ALL_MODELS, DTYPES, MASKS, MODELS, REWARD_MODELS, RULE_MASKS, USER_PREFIX, is_user_model,
                                option_keys, options_class, parse_options, spec)
from rewardstack._settings import (TABLES, InputSettings, MemorySettings, ServiceSettings, Table, TelemetrySettings,
                                  parse_table, unknown_key_error)

# The model names and their defaults (the openvalidators 1.2.0 default stack) are declared once, in
# the model registry (`rewardstack._models`); these names are kept here for the modules that read them.
DEFAULTS: dict[str, dict[str, Any]] = {m.name: dict(m.defaults) for m in MODELS}

Text = Annotated[str, Field(pattern=r"\S")]
"""A string with more than whitespace in it (a path, a folder)."""


class ModelConfig(Table):
    """One reward model or mask of the stack."""

    name: str
    """The spec's event name, e.g. `rlhf_reward_model`."""
    path: Text | None = None
    """Hub id or local directory of the checkpoint."""
    paths: list[Text] = []
    """Several checkpoints, in order (the relevance filter's two embedding models)."""
    weight: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight in the combination (reward models only)."""
    enabled: bool = True
    """Masks: whether the mask is applied. Reward models: derived, weight > 0."""
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    """Weights dtype: float32, float16 or bfloat16."""
    revision: str | None = None
    """Hub revision (ignored for local directories)."""
    max_length: int | None = Field(None, gt=0)
    """Override of the model's input-length bound, in tokens."""
    batch_size: int | None = Field(None, gt=0)
    """Upper bound on the batch size the planner may choose."""
    trust_remote_code: bool = False
    """Let the checkpoint run its own modeling code: only from a commit locked by `rewardstack download`, or from a local folder."""
    options: ModelOptions = NoOptions()
    """The scorer's options (written flat in the model's table): the options class its model declares in `rewardstack._modeloptions`, every key left out at its default."""
    locked: dict[str, str] = {}
    """Hub id -> commit, from the lock file beside the config (`rewardstack._lockfile`); not a config key."""

    @model_validator(mode="before")
    @classmethod
    def _declared_options(cls, data: Any) -> Any:
        """`options` as the model's declared class: given as a dict (configured in code), checked as a
        table is; left out, the defaults."""
        name, options = str(data.get("name")), data.get("options")
        declared = options_class(name)
        if isinstance(options, Mapping):
            return {**data, "options": parse_options(name, options)}
        if options is None or type(options) is NoOptions:
            return {**data, "options": declared()}
        if not isinstance(options, declared):
            raise TypeError(f"{name}: options must be {declared.__name__} or a dict, got {type(options).__name__}")
        return data

    @property
    def is_reward(self) -> bool:
        """Whether this is a weighted reward model (as opposed to a mask)."""
        return self.name in REWARD_MODELS

    @property
    def active(self) -> bool:
        """Whether the model is loaded and run."""
        return self.weight > 0 if self.is_reward else self.enabled


class StackConfig(Table):
    """The whole stack: device, state directory, memory settings and one ModelConfig per model."""

    device: str = "cpu"
    """Torch device the models run on: `cpu`, `cuda`, `cuda:0`, ..."""
    state_dir: Text = Field(default_factory=lambda: str(paths.state_dir(None)),
                            json_schema_extra={"shown_default": "$REWARDSTACK_HOME/<config stem>-<hash>/state"})
    """Folder for state that outlives the process (normalizer statistics, diversity history); relative to the config file. Unset: $REWARDSTACK_HOME/<config stem>-<hash>/state (rewardstack._paths)."""
    memory_budget: int | None = Field(None, gt=0)
    """Activation budget in bytes. On CUDA, None means total memory x utilization minus weights minus headroom; on CPU, None means unlimited."""
    gpu_utilization: float = Field(0.9, gt=0, le=1)
    """Share of the device's total memory rewardstack may use (like vLLM's gpu_memory_utilization)."""
    headroom_bytes: int = Field(512 * 1024**2, ge=0)
    """Bytes kept free on the device beyond the budget."""
    safety_margin: float = Field(0.9, gt=0, le=1)
    """Share of the budget the batch planner fills with predicted peaks."""
    models: dict[str, ModelConfig] = {}
    memory: MemorySettings = Field(default_factory=MemorySettings)
    """The `[memory]` table (see `rewardstack._settings`)."""
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    """The `[telemetry]` table."""
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    """The `[service]` table."""
    input: InputSettings = Field(default_factory=InputSettings)
    """The `[input]` table: characters per text and completions per step the stack reads."""
    source: Path | None = None
    """The file the config was read from (None if built in code)."""

    def active_models(self) -> list[ModelConfig]:
        """The models that are loaded and run, in the spec's order, then the user-named reward models."""
        return [self.models[n] for n in ALL_MODELS if self.models[n].active] + self.user_rewards()

    def user_rewards(self) -> list[ModelConfig]:
        """The active user-named reward models (`[rewards.<name>]`), in the file's order."""
        return [m for n, m in self.models.items() if is_user_model(n) and m.active]

    def reward_weights(self) -> dict[str, float]:
        """Weight of every reward model (0 for the ones off)."""
        return {n: self.models[n].weight for n in REWARD_MODELS}


_TOP_KEYS = set(StackConfig.model_fields) - {"source"} | {"rewards"}
_MODEL_KEYS = set(ModelConfig.model_fields) - {"name", "locked"}


def _resolve(path: str, base: Path | None) -> str:
    """A relative path that exists under the config's folder becomes absolute; hub ids stay."""
    if base is None or Path(path).is_absolute():
        return path
    candidate = base / path
    if candidate.exists() or path.startswith((".", "/")):
        return str(candidate.resolve())
    return path


def _model_from(name: str, raw: dict[str, Any], base: Path | None) -> ModelConfig:
    merged = copy.deepcopy(DEFAULTS.get(name, {}))
    explicit = set(raw)
    several = spec(name).checkpoints
    if several > 1 and "path" in explicit:
        raise ConfigError(f"models.{name}.path", f"the {_title(name)} takes `paths` (its {_count(several)} embedding models)")
    if several == 1 and "paths" in explicit:
        raise ConfigError(f"models.{name}.paths", "this model takes a single `path`")
    merged.update(raw)
    # A path given alone replaces the default pair and vice versa; a default revision pin or
    # remote-code opt-in belongs to the default checkpoint, not to whatever path the operator names.
    if explicit & {"path", "paths"}:
        for key in {"path", "paths", "revision", "trust_remote_code"} - explicit:
            merged.pop(key, None)
    prefix = name if is_user_model(name) else f"models.{name}"
    opt_keys = option_keys(name)
    nested = merged.get("options", {})
    if not isinstance(nested, dict):
        raise ConfigError(f"{prefix}.options", "must be a table of the model's options")
    for key in list(merged) + list(nested):
        if key not in _MODEL_KEYS and key not in opt_keys:
            raise unknown_key_error(f"{prefix}.", key, (_MODEL_KEYS - {"options"}) | opt_keys)
    known = {k: v for k, v in merged.items() if k in _MODEL_KEYS}
    options = {**nested, **{k: v for k, v in merged.items() if k in opt_keys}}
    if "weight" in known and name not in REWARD_MODELS and not is_user_model(name):
        raise ConfigError(f"{prefix}.weight", "masks take `enabled`, not `weight`")
    cfg = parse_table(ModelConfig, {**known, "name": name, "options": parse_options(name, options)}, prefix)
    cfg.path = _resolve(cfg.path, base) if cfg.path is not None else None
    cfg.paths = [_resolve(p, base) for p in cfg.paths]
    if name in REWARD_MODELS and "enabled" in explicit and raw["enabled"] is False:
        cfg.weight = 0.0
    if cfg.active and name not in RULE_MASKS and not cfg.path and not cfg.paths:
        raise ConfigError(f"{prefix}.path", "missing: an active model needs a hub id or local folder")
    if several > 1 and cfg.active and len(cfg.paths) != several:
        raise ConfigError(f"{prefix}.paths", f"the {_title(name)} takes exactly {_count(several)} embedding models")
    return cfg


_USER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def _user_rewards(raw: Any, base: Path | None) -> dict[str, ModelConfig]:
    """The `[rewards.<name>]` tables: user-named HF reward models, as `rewards.<name>` ModelConfigs."""
    if not isinstance(raw, dict):
        raise ConfigError("rewards", "must be a table of reward model tables, e.g. [rewards.helpful]")
    out: dict[str, ModelConfig] = {}
    for name, table in raw.items():
        where = USER_PREFIX + str(name)
        if not _USER_NAME.match(str(name)):
            raise ConfigError(where, "a reward model's name is a letter, then letters, digits, _ or - (64 at most)")
        if not isinstance(table, dict):
            raise ConfigError(where, "must be a table")
        if "path" not in table:
            raise ConfigError(f"{where}.path", "missing: a hub id (with a revision) or a local folder")
        if "paths" in table:
            raise ConfigError(f"{where}.paths", "a reward model takes a single `path`")
        table = {**table, "weight": table.get("weight", 1.0)}
        out[where] = _model_from(where, table, base)
        if is_hub_id(out[where].path or "") and not out[where].revision:
            raise ConfigError(f"{where}.revision", "a hub id needs a locked revision (a commit, or a tag that "
                              "`rewardstack download` locks); a local folder needs none")
    return out


def _title(name: str) -> str:
    """`relevance_filter` -> `relevance filter` (how messages name a model)."""
    return name.replace("_", " ")


def _count(n: int) -> str:
    return {2: "two", 3: "three"}.get(n, str(n))


def from_dict(data: dict[str, Any], *, base: Path | None = None, source: Path | None = None) -> StackConfig:
    """Validate a parsed TOML document into a StackConfig."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", "must be a table")
    for key in data:
        if key not in _TOP_KEYS:
            raise unknown_key_error("", key, _TOP_KEYS)
    rewards_raw = data.get("rewards", {})
    # User-named reward models alone: the openvalidators models are the default only of a config
    # that names none (or that has a [models] table of its own).
    default_raw = {n: {"enabled": False} for n in ALL_MODELS} if rewards_raw and "models" not in data else {}
    models_raw = data.get("models", default_raw)
    if not isinstance(models_raw, dict):
        raise ConfigError("models", "must be a table of model tables")
    for name, raw in models_raw.items():
        if name not in ALL_MODELS:
            raise ConfigError(f"models.{name}", f"unknown model; expected one of: {', '.join(ALL_MODELS)}")
        if not isinstance(raw, dict):
            raise ConfigError(f"models.{name}", "must be a table")
    top = {k: v for k, v in data.items() if k not in ("models", "rewards") and k not in TABLES}
    tables = {name: parse_table(cls, data.get(name), name) for name, cls in TABLES.items()}
    for table, key in (("telemetry", "run_dir"), ("memory", "calibration_file"), ("service", "tokens_file")):
        if getattr(tables[table], key) is not None:  # relative to the config file
            setattr(tables[table], key, _resolve_dir(getattr(tables[table], key), base))
    cfg = parse_table(StackConfig, {**top, **tables, "source": source}, "")
    if "state_dir" in top:
        cfg.state_dir = _resolve_dir(cfg.state_dir, base)
    else:
        cfg.state_dir = str(paths.state_dir(source))
        _warn_of_old_state(cfg.state_dir)
    cfg.models = {n: _model_from(n, models_raw.get(n, {}), base) for n in ALL_MODELS}
    cfg.models.update(_user_rewards(rewards_raw, base))
    total = sum(cfg.models[n].weight for n in REWARD_MODELS)
    if abs(total - 1.0) > 1e-6 and not (total == 0 and cfg.user_rewards()):
        parts = ", ".join(f"{n}={cfg.models[n].weight:g}" for n in REWARD_MODELS if cfg.models[n].weight)
        raise ConfigError("models.*.weight", f"reward model weights must sum to 1, got {total:g} ({parts})")
    return cfg


def _warn_of_old_state(default: str) -> None:
    """Name a state left in ./state by an older rewardstack (whose default that was), once per folder:
    silently starting a fresh state would reset the normalizer statistics."""
    old = Path.cwd() / "state"
    if (old / "state.safetensors").exists() and old.resolve() not in _WARNED and not Path(default).exists():
        _WARNED.add(old.resolve())
        log.warning("%s holds a state, but a config without state_dir now keeps its state in %s: "
                    "set state_dir = %r in the config to keep using the old one", old, default, str(old.resolve()))


_WARNED: set[Path] = set()
log = logging.getLogger("rewardstack.config")


def _resolve_dir(path: str, base: Path | None) -> str:
    if base is None or Path(path).is_absolute():
        return path
    return str((base / path).resolve())


# -- the lock file, applied (lockfile.py knows the file; the config knows its models' hub ids) --
_lock_log = logging.getLogger("rewardstack.hub")


def hub_ids(cfg: ModelConfig) -> list[str]:
    """Every hub id one model's config names, in order (paths, then the `base_config` option's)."""
    out = [p for p in ([cfg.path] if cfg.path else []) + list(cfg.paths) if is_hub_id(p)]
    # A model whose options name a base config (Dahoas: the body shape and tokenizer, read only
    # when the folder lacks them) locks it too: it is the same kind of moving target.
    base = getattr(cfg.options, "base_config", None)
    if base is not None and is_hub_id(base):
        out.append(base)
    return list(dict.fromkeys(out))


def apply_lock(cfg: StackConfig) -> None:
    """Pin the config's hub ids to the commits of the lock file beside it (if there is one).

    An entry whose requested revision is not what the config asks for now is stale: an error that
    says to run `download` again (loading another revision than the one locked would defeat it).
    """
    p = lock_path(cfg.source) if cfg.source is not None else None
    if p is None or not p.exists():
        return
    for e in read_lock(p):
        mc = cfg.models.get(e.model)
        if mc is None or e.hub_id not in hub_ids(mc):
            _lock_log.info("lock file %s: %s no longer names %s (entry ignored)", p.name, e.model, e.hub_id)
            continue
        requested = mc.revision if e.hub_id in ([mc.path] if mc.path else []) + list(mc.paths) else None
        if requested != e.requested_revision:
            raise ConfigError(
                f"models.{e.model}.revision",
                f"the config asks for {requested or 'the default branch'} of {e.hub_id} but {p.name} locked "
                f"{e.requested_revision or 'the default branch'}; run `rewardstack download --config {cfg.source}`",
            )
        mc.locked[e.hub_id] = e.commit


def load_config(path: str | Path) -> StackConfig:
    """Read and validate a TOML config file (the lock file beside it pins hub revisions)."""
    return build_config(path)


def reward_model_name(spec: str) -> str:
    """The `[rewards.<name>]` name a `--reward-model` gets: its folder's or hub id's last part, with
    what a table name may not hold (dots, spaces) turned into `-`."""
    last = Path(spec.rstrip("/")).name or "model"
    name = re.sub(r"[^A-Za-z0-9_-]", "-", last)
    return (name if name[:1].isalpha() else "rm-" + name)[:64]


def reward_model_tables(specs: list[str]) -> dict[str, dict[str, Any]]:
    """The `[rewards.<name>]` tables a TOML would hold for `--reward-model` flags: `PATH` (a local
    folder, made absolute) or `HUB_ID@REVISION`. Two models whose names clash get `-2`, `-3`."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        entry: dict[str, Any] = {}
        path = spec
        if not Path(spec).expanduser().exists() and "@" in spec:
            path, entry["revision"] = spec.rsplit("@", 1)
        if is_hub_id(path):
            if "revision" not in entry:
                raise ConfigError("--reward-model", f"{spec!r} is neither a folder here nor a pinned hub id: give "
                                  f"{spec}@<commit or tag> (a hub model loads at a stated revision)")
        else:
            path = str(Path(path).expanduser().resolve())
        name = base = reward_model_name(path)
        k = 2
        while name in out:
            name, k = f"{base[:60]}-{k}", k + 1
        out[name] = {"path": path, **entry}
    return out


def build_config(path: str | Path | None = None, reward_models: list[str] | tuple[str, ...] = (), *,
                 device: str | None = None, **table: Any) -> StackConfig:
    """The config of a command's flags: the TOML at `path` (or none), with one `[rewards.<name>]`
    table per `--reward-model` (`reward_model_tables`) and `table`'s keys (dtype, max_length,
    truncation_side, chat_template) set on every `[rewards.*]` table, the file's included.

    `device` overrides the file's; with neither, CUDA where torch finds it, else the CPU. A name the
    file's `[rewards]` already holds is refused (the flag does not silently replace the table).
    """
    data: dict[str, Any] = {}
    source = base = None
    if path is not None:
        source = Path(path).resolve()
        base = source.parent
        try:
            data = tomllib.loads(source.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError("<file>", f"cannot read {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("<file>", f"{path} is not valid TOML: {e}") from e
    if reward_models or any(v is not None for v in table.values()):
        rewards = data.setdefault("rewards", {})
        if not isinstance(rewards, dict):
            raise ConfigError("rewards", "must be a table of reward model tables, e.g. [rewards.helpful]")
        for name, entry in reward_model_tables(list(reward_models)).items():
            if name in rewards:
                raise ConfigError("--reward-model", f"rewards.{name} is in {path} already; give the flag's model "
                                  "another folder name or leave it out of one of the two")
            rewards[name] = entry
        if not rewards:
            flag = next(k for k, v in table.items() if v is not None)
            raise ConfigError("--" + flag.replace("_", "-"), "applies to [rewards.*] models: name one with --reward-model")
        for entry in rewards.values():
            if isinstance(entry, dict):
                entry.update({k: v for k, v in table.items() if v is not None})
    if device is not None:
        data["device"] = device
    elif path is None:
        import torch

        data["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = from_dict(data, base=base, source=source)
    if source is not None:
        apply_lock(cfg)
    return cfg


def default_config() -> StackConfig:
    """The openvalidators default stack (hub ids)."""
    return from_dict({})
