"""The lock file: which commit each hub id of a config was pinned to, read, written and applied.

`rewardstack download` (`rewardstack.hub`) writes `C.lock.json` beside a config `C.toml`:

    {"version": 1, "config": "stack.toml", "models": [
      {"model": "dpo_reward_model", "hub_id": "cerebras/btlm-3b-8k-base", "requested_revision": null,
       "commit": "<40 hex digits from the hub>", "trust_remote_code": true}, ...]}

`load_config` applies it (`apply_lock`): every locked hub id then loads at its commit. This module
knows the file and a model config's hub ids, nothing of the hub itself, so the config layer can
apply a lock without importing the code that talks to the hub (which sits above it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rewardstack.errors import ConfigError
from rewardstack.fileio import atomic_write_text

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig, StackConfig

log = logging.getLogger("rewardstack.hub")

LOCK_VERSION = 1
COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
"""What a hub repository id looks like (`owner/name` or `name`)."""


@dataclass
class LockEntry:
    """One hub id of one model, pinned."""

    model: str
    """The model's event name, e.g. `dpo_reward_model`."""
    hub_id: str
    """The repository on the hub."""
    requested_revision: str | None
    """What the config asked for (None: the default branch)."""
    commit: str
    """The commit that revision resolved to when `download` ran."""
    trust_remote_code: bool = False
    """Whether the config lets this model run its repository's code."""


def lock_path(config_path: str | Path) -> Path:
    """The lock file of a config: `stack.toml` -> `stack.lock.json`, in the same folder."""
    p = Path(config_path)
    return p.with_name(p.stem + ".lock.json")


def is_hub_id(path: str) -> bool:
    """Whether `path` names a hub repository rather than a local folder."""
    if os.path.isabs(path) or path.startswith(".") or Path(path).exists():
        return False
    return bool(HUB_ID.fullmatch(path))


def hub_ids(cfg: "ModelConfig") -> list[str]:
    """Every hub id one model's config names, in order (paths, then the `base_config` option's)."""
    out = [p for p in ([cfg.path] if cfg.path else []) + list(cfg.paths) if is_hub_id(p)]
    # A model whose options name a base config (Dahoas: the body shape and tokenizer, read only
    # when the folder lacks them) locks it too: it is the same kind of moving target.
    base = getattr(cfg.options, "base_config", None)
    if base is not None and is_hub_id(base):
        out.append(base)
    return list(dict.fromkeys(out))


def write_lock(path: Path, entries: list[LockEntry], *, config_name: str | None = None) -> None:
    """Write the lock file atomically (a half-written lock is never read)."""
    doc = {"version": LOCK_VERSION, "config": config_name, "models": [asdict(e) for e in entries]}
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def read_lock(path: str | Path) -> list[LockEntry]:
    """The entries of a lock file; errors name the file and what is wrong."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(str(p), f"unreadable lock file ({e}); run `rewardstack download` again") from e
    if not isinstance(doc, dict) or doc.get("version") != LOCK_VERSION or not isinstance(doc.get("models"), list):
        raise ConfigError(str(p), f"not a version-{LOCK_VERSION} lock file; run `rewardstack download` again")
    out = []
    for k, raw in enumerate(doc["models"]):
        try:
            e = LockEntry(**raw)
        except TypeError as exc:
            raise ConfigError(f"{p}: models[{k}]", f"malformed entry ({exc})") from exc
        if not isinstance(e.commit, str) or not COMMIT.fullmatch(e.commit):
            raise ConfigError(f"{p}: models[{k}].commit", f"must be 40 hex digits, got {e.commit!r}")
        out.append(e)
    return out


def apply_lock(cfg: "StackConfig", path: str | Path | None = None) -> Path | None:
    """Pin the config's hub ids to the commits of its lock file (if there is one); returns that file.

    An entry whose requested revision is not what the config asks for now is stale: an error that
    says to run `download` again (loading another revision than the one locked would defeat it).
    """
    if path is None:
        if cfg.source is None:
            return None
        path = lock_path(cfg.source)
    p = Path(path)
    if not p.exists():
        return None
    for e in read_lock(p):
        mc = cfg.models.get(e.model)
        if mc is None or e.hub_id not in hub_ids(mc):
            log.info("lock file %s: %s no longer names %s (entry ignored)", p.name, e.model, e.hub_id)
            continue
        requested = mc.revision if e.hub_id in ([mc.path] if mc.path else []) + list(mc.paths) else None
        if requested != e.requested_revision:
            raise ConfigError(
                f"models.{e.model}.revision",
                f"the config asks for {requested or 'the default branch'} of {e.hub_id} but {p.name} locked "
                f"{e.requested_revision or 'the default branch'}; run `rewardstack download --config {cfg.source}`",
            )
        mc.locked[e.hub_id] = e.commit
    return p
