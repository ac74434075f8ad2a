"""The calibration cache: fitted cost models (and tuned settings) saved in rewardstack's home, reused at start.

Profiling every model at every start costs a forward pass per profiled shape per model (minutes for
the full stack on a card). The fits depend only on what was measured and where, so each one is
stored under a key made of:

- the model: its checkpoint by content (`checkpoint_identity`: a local folder by the sha256 of its
  weight and config files, a hub id by its id and revision) and the scorer's settings (name, dtype,
  max_length, batch size, options); not the config file or the folder the checkpoint sits in,
- the profile: the calibration's own arguments (longest length, batch, token cap, shapes, chunk),
- the machine: the device's name (the GPU model, or `cpu`), and the torch and transformers versions.

So every config that loads the same checkpoint the same way shares the fit: stand-ins built again
in another folder are not profiled again. A later start with the same key reads the fit instead of
profiling; any change to one of these, or `--recalibrate`, profiles again (and overwrites the
entry). One JSON file for every config, written atomically (entries another process wrote in the
meantime are kept), at `$REWARDSTACK_HOME/calibration/cache.json` (`rewardstack._paths`; a config's
`[memory] calibration_file` overrides), separate from the scoring state (`state_dir`): deleting
it only costs the next start its profile runs. It also keeps each checkpoint file's digest by the
file's path, size, modification time and inode, so a file is hashed once, not at every start. A
damaged file is logged and ignored (the start profiles), never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rewardstack import _paths as paths
from rewardstack._fileio import atomic_write_text

log = logging.getLogger("rewardstack.memory")

FORMAT = 4  # 2: prefixed and lone passes, the denser length grid; 3: two-piece fits (`CostModel.alt`); 4: keyed by checkpoint content
CHECKPOINT_FILES = (".safetensors", ".bin", ".pt", ".json")  # what a fit depends on in a checkpoint folder
_CHUNK = 1 << 22


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
    the home's one cache (`paths.calibration_file()`), shared by every config file; None for a
    config built in code (its fits stay in memory, as they always have)."""
    if explicit is not None:
        return Path(explicit)
    if config_source is None:
        return None
    return paths.calibration_file()


def checkpoint_identity(path: str, cache: "CalibrationCache | None" = None) -> dict[str, Any]:
    """What a fit depends on of one checkpoint: a local folder by the sha256 over its weight and
    config files' names and contents (a copy elsewhere is the same checkpoint; a file rewritten is
    another), a hub id as given (its revision is in the scorer's settings). `cache` remembers
    each file's digest so that unchanged files are not read again."""
    folder = Path(path)
    if not folder.is_dir():
        return {"hub": path}
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in CHECKPOINT_FILES and f.is_file():
            h.update(f"{f.name}\0{cache.file_digest(f) if cache is not None else file_digest(f)}\0".encode())
    return {"sha256": h.hexdigest()}


def file_digest(path: Path) -> str:
    """The sha256 of a file's content, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class CalibrationCache:
    """Entries of fitted cost models by key, in one JSON file (None: kept in memory only)."""

    def __init__(self, path: Path | str | None, *, recalibrate: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.recalibrate = recalibrate
        self.hits = 0
        self.misses = 0
        self._entries, self._digests = self._read(warn=True)
        self._unsaved = False  # digests computed since the file was written

    def _read(self, *, warn: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]]]:
        if self.path is None or not self.path.exists():
            return {}, {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"unknown format {data.get('format')!r}")
            digests = data.get("digests")
            return dict(data["entries"]), dict(digests) if isinstance(digests, dict) else {}
        except (OSError, ValueError, AttributeError) as e:
            if warn:
                log.warning("calibration cache %s unreadable (%s): profiling again", self.path, e)
            return {}, {}

    def file_digest(self, path: Path) -> str:
        """`file_digest(path)`, remembered by the file's absolute path, size, mtime and inode."""
        st = path.stat()
        ident = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(path.resolve())
        seen = self._digests.get(key)
        if isinstance(seen, list) and len(seen) == 4 and seen[:3] == ident:
            return str(seen[3])
        digest = file_digest(path)
        self._digests[key] = [*ident, digest]
        self._unsaved = True
        return digest

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
        self._unsaved = True
        self.save()

    def save(self) -> None:
        """Write entries and digests if anything is new (nothing for an in-memory cache)."""
        if self.path is None or not self._unsaved:
            return
        # One file for every config: keep what other processes saved since this one read it.
        entries, digests = self._read()
        self._entries = {**entries, **self._entries}
        self._digests = {**digests, **self._digests}
        data = {"format": FORMAT, "entries": self._entries, "digests": self._digests}
        try:
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True))
            self._unsaved = False
        except OSError as e:  # a read-only home costs the next start a profile, nothing else
            log.warning("calibration cache %s not written: %s", self.path, e)

    def __len__(self) -> int:
        return len(self._entries)
