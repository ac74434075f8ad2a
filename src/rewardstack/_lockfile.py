"""The lock file: which commit each hub id of a config was pinned to, read, written and applied.

`rewardstack download` (`rewardstack._hub`) writes `C.lock.json` beside a config `C.toml`:

    {"version": 1, "config": "stack.toml", "models": [
      {"model": "dpo_reward_model", "hub_id": "cerebras/btlm-3b-8k-base", "requested_revision": null,
       "commit": "<40 hex digits from the hub>", "trust_remote_code": true}, ...]}

`load_config` applies it (`config.apply_lock`): every locked hub id then loads at its commit. This
module knows the file and what a hub id looks like, nothing of the hub itself nor of a config, so
the config layer can apply a lock without importing the code that talks to the hub (which sits
above it), and the lock file imports nothing of the config.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from rewardstack.errors import ConfigError
from rewardstack._fileio import atomic_write_text

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
