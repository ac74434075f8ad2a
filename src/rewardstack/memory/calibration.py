"""The calibration cache: fitted cost models (and tuned settings) saved in the config's home, reused at start.

Profiling every model at every start costs a forward pass per profiled shape per model (minutes for
the full stack on a card). The fits depend only on what was profiled and where, so each one is
stored under a key made of:

- the model: the scorer's config entry (path(s), revision, dtype, max_length, batch size, options),
- the profile: the calibration's own arguments (longest length, batch, token cap, shapes, chunk),
- the machine: the device's name (the GPU model, or `cpu`), and the torch and transformers versions.

A later start with the same key reads the fit instead of profiling; any change to one of these, or
`--recalibrate`, profiles again (and overwrites the entry). The file is JSON, written atomically,
at `$REWARDSTACK_HOME/<config stem>-<hash>/calibration/cache.json` (`rewardstack.paths`; the
config's `[memory] calibration_file` overrides), separate from the scoring state (`state_dir`):
deleting it only costs the next start its profile runs. A damaged file is logged and ignored (the
start profiles), never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rewardstack import paths
from rewardstack.fileio import atomic_write_text

log = logging.getLogger("rewardstack.memory")

FORMAT = 3  # 2: prefixed and lone passes, the denser length grid; 3: two-piece fits (`CostModel.alt`)


def device_name(device: torch.device | str) -> str:
    """What the fits depend on about the device: the GPU's model name, or the device type."""
    dev = torch.device(device)
    if dev.type == "cuda":  # pragma: no cover - CUDA-only path
        return torch.cuda.get_device_name(dev)
    return dev.type


def environment(device: torch.device | str) -> dict[str, str]:
    """The machine part of a calibration key."""
    import transformers

    return {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__}


def calibration_key(model: dict[str, Any], profile: dict[str, Any], env: dict[str, str]) -> str:
    """A stable digest of (model, profile arguments, environment)."""
    blob = json.dumps({"model": model, "profile": profile, "env": env, "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


def cache_path_for(config_source: Path | str | None, explicit: str | Path | None = None) -> Path | None:
    """The calibration cache of a config: `explicit` (its `[memory] calibration_file`) if set, else
    `paths.calibration_file(config)` in rewardstack's home; None for a config built in code (its fits
    stay in memory: it has no file to key a home by that a later start would find again)."""
    if explicit is not None:
        return Path(explicit)
    if config_source is None:
        return None
    return paths.calibration_file(config_source)


class CalibrationCache:
    """Entries of fitted cost models by key, in one JSON file (None: kept in memory only)."""

    def __init__(self, path: Path | str | None, *, recalibrate: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.recalibrate = recalibrate
        self.hits = 0
        self.misses = 0
        self._entries: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"unknown format {data.get('format')!r}")
            return dict(data["entries"])
        except (OSError, ValueError, AttributeError) as e:
            log.warning("calibration cache %s unreadable (%s): profiling again", self.path, e)
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored entry for `key` (None if absent, or always with `recalibrate`)."""
        entry = None if self.recalibrate else self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store an entry and write the file atomically (temp file + rename)."""
        self._entries[key] = dict(entry, saved=time.time())
        if self.path is None:
            return
        data = {"format": FORMAT, "entries": self._entries}
        try:
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True))
        except OSError as e:  # a read-only config folder costs the next start a profile, nothing else
            log.warning("calibration cache %s not written: %s", self.path, e)

    def __len__(self) -> int:
        return len(self._entries)
