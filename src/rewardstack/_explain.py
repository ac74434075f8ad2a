"""`rewardstack config`: every key a config file takes, and a check of one config file.

`explain()` lists the top-level keys, the `[memory]`, `[telemetry]` and `[service]` tables, the keys
every `[models.*]` table takes, and each model's own options with its defaults: key, type,
default and one line of help, all read from the models that validate them (so the listing and
the validation cannot disagree). `check(path)` validates a config and its lock file and says, per
model, what will be loaded from where.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel

from rewardstack.config import ModelConfig, StackConfig, load_config
from rewardstack._models import MODELS, options_class
from rewardstack._settings import BYTES, TABLES

_NOT_KEYS = {"name", "locked", "options", "models", "source", *TABLES}


def _kind(hint: Any) -> str:
    """A type as the listing says it: `int | None`, `list`; `Bytes` as bytes, choices as str."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return "bytes" if BYTES in args else _kind(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [_kind(a) for a in args]
        return "bytes" if "bytes" in kinds else " | ".join(kinds)
    return "str" if origin is Literal else "None" if hint is type(None) else getattr(origin or hint, "__name__", str(hint))


def _rows(cls: type[BaseModel]) -> list[str]:
    """Key, type, default and help of every setting of a table."""
    out = []
    for name, f in cls.model_fields.items():
        if name in _NOT_KEYS:
            continue
        kind = "bytes" if BYTES in f.metadata else _kind(f.annotation)
        shown = (f.json_schema_extra or {}).get("shown_default", repr(f.get_default(call_default_factory=True)))  # type: ignore[union-attr]
        out.append(f"  {name:<28} {kind:<12} {shown:<24}")
        out.extend(textwrap.wrap(f.description or "", width=96, initial_indent="      ", subsequent_indent="      "))
    return out


def explain() -> str:
    """Every key of the config file: key, type, default, help."""
    lines = ["Top-level keys:"]
    lines += _rows(StackConfig)
    for name, cls in TABLES.items():
        lines += ["", f"[{name}]:"]
        lines += _rows(cls)
    lines += ["", "[models.<name>]: keys every model takes (<name> is an event name below):"]
    lines += _rows(ModelConfig)
    for m in MODELS:  # the model registry, in the spec's order
        name = m.name
        defaults = ", ".join(f"{k} = {json.dumps(v)}" for k, v in m.defaults.items())
        lines += ["", f"[models.{name}]: defaults {defaults}"]
        opts = _rows(options_class(m.name))
        lines += opts if opts else ["  (no options of its own)"]
    return "\n".join(lines) + "\n"


def check(path: str | Path) -> str:
    """Validate a config file (and the lock file beside it); one line per active model."""
    from rewardstack.config import hub_ids
    from rewardstack._lockfile import lock_path

    cfg = load_config(path)
    lock = lock_path(path)
    lines = [f"{path}: valid; lock file {lock.name}: {'present' if lock.exists() else 'none'}"]
    for mc in cfg.active_models():
        where = [mc.path] if mc.path else list(mc.paths)
        pins = [f"{h}@{mc.locked[h][:12]}" for h in hub_ids(mc) if h in mc.locked]
        unpinned = [h for h in hub_ids(mc) if h not in mc.locked]
        text = f"  {mc.name}: {', '.join(where) or '(rules)'}"
        if pins:
            text += f"; locked {', '.join(pins)}"
        if unpinned:
            text += f"; not locked: {', '.join(unpinned)}"
        if mc.trust_remote_code:
            text += "; runs its own code" + ("" if not unpinned else " (refused until `rewardstack download`)")
        lines.append(text)
    return "\n".join(lines) + "\n"
