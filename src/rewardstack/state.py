"""Atomic persistence of everything that must outlive the process, in one safetensors file.

Tensors (the diversity history) are stored as tensors; everything else (normalizer statistics,
blacklist lists) is JSON in the file's metadata. A save writes a temporary file in the same folder,
fsyncs it, renames it over the old file and fsyncs the folder, so a kill at any moment leaves either
the complete old state or the complete new one. Never pickle.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from rewardstack.errors import StateError

log = logging.getLogger("rewardstack.state")

STATE_FILE = "state.safetensors"
_JSON_KEY = "rewardstack_json"
FORMAT_VERSION = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class StateStore:
    """Reads and writes `{section: {key: tensor | JSON value}}` to `<state_dir>/state.safetensors`."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE

    def save(self, sections: dict[str, dict[str, Any]]) -> None:
        """Atomically replace the stored state with `sections`."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict[str, dict[str, Any]] = {}
        for section, values in sections.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{section}/{key}"] = value.detach().to("cpu").contiguous()
                else:
                    plain.setdefault(section, {})[key] = value
        meta = {_JSON_KEY: json.dumps({"version": FORMAT_VERSION, "sections": plain}, allow_nan=False)}
        atomic_write_bytes(self.path, save(tensors, metadata=meta))

    def _remove_stale_temps(self) -> None:
        """Delete temp files a killed save left behind (one writer per state dir is assumed)."""
        if self.dir.is_dir():
            for tmp in self.dir.glob(f".{STATE_FILE}.*.tmp"):
                tmp.unlink(missing_ok=True)

    def load(self) -> dict[str, dict[str, Any]]:
        """The stored sections ({} when nothing was saved yet). Raises StateError if unreadable."""
        self._remove_stale_temps()
        if not self.path.exists():
            return {}
        try:
            tensors = load_file(self.path)
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                meta = f.metadata() or {}
            doc = json.loads(meta.get(_JSON_KEY, "{}"))
        except (SafetensorError, OSError, ValueError) as e:
            raise StateError(f"cannot read state file {self.path}: {e}") from e
        sections: dict[str, dict[str, Any]] = {s: dict(v) for s, v in doc.get("sections", {}).items()}
        for name, t in tensors.items():
            section, _, key = name.partition("/")
            sections.setdefault(section, {})[key] = t
        return sections
