"""Atomic, versioned persistence of everything that must outlive the process, in one safetensors file.

Tensors (the diversity history) are stored as tensors; everything else (normalizer statistics,
blacklist lists, kept answers, the namespace's session, the commit journal of `rewardstack.runner`)
is one JSON document, stored as UTF-8 bytes in a uint8 tensor of the file's body (`rewardstack_json`),
not in the safetensors header, which is capped at 100 MB and escapes every non-ASCII character. A
save writes a temporary file in the same folder, fsyncs it, renames it over the old file and fsyncs
the folder, so a kill at any moment leaves either the complete old state or the complete new one.
Never pickle.

The file states its format (`FORMAT_VERSION`). Formats 1 and 2 kept the JSON in the header's
metadata; they are read as they are, and the first save over one writes the current format after
copying the original to `state.v<N>.safetensors`. A file from a newer rewardstack is refused with a
clear `StateError` and left untouched.

One writer per state directory: `StateLock` takes an exclusive `fcntl.flock` on `<dir>/lock`; a
second process is refused with `StateLockedError` naming the holder's pid.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from rewardstack.errors import StateError
from rewardstack._fileio import atomic_write_bytes, fsync_dir

log = logging.getLogger("rewardstack.state")

STATE_FILE = "state.safetensors"
LOCK_FILE = "lock"
_JSON_KEY = "rewardstack_json"
"""The JSON document: a metadata key up to format 2, a uint8 tensor of the body from format 3."""
_VERSION_KEY = "rewardstack_format"
FORMAT_VERSION = 3


class StateLockedError(StateError):
    """Another process holds the state directory's lock."""


class StateStore:
    """Reads and writes `{section: {key: tensor | JSON value}}` to `<state_dir>/state.safetensors`."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.loaded_version: int | None = None
        """The format version of the file last loaded (None: nothing loaded yet, or no file)."""

    def save(self, sections: dict[str, dict[str, Any]]) -> None:
        """Atomically replace the stored state with `sections` (in the current format)."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict[str, dict[str, Any]] = {}
        for section, values in sections.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{section}/{key}"] = value.detach().to("cpu").contiguous()
                else:
                    plain.setdefault(section, {})[key] = value
        doc = json.dumps({"version": FORMAT_VERSION, "sections": plain}, allow_nan=False, ensure_ascii=False)
        tensors[_JSON_KEY] = torch.frombuffer(bytearray(doc.encode("utf-8")), dtype=torch.uint8)
        data = save(tensors, metadata={_VERSION_KEY: str(FORMAT_VERSION)})
        self._keep_older_format()
        atomic_write_bytes(self.path, data, mode=0o600)  # private, as before
        self.loaded_version = FORMAT_VERSION
        log.debug("state saved to %s: %d bytes (%d of JSON)", self.path, len(data), len(doc))

    def _keep_older_format(self) -> None:
        """Before the first save over a migrated file, keep the original beside it."""
        old = self.loaded_version
        if old is None or old >= FORMAT_VERSION or not self.path.exists():
            return
        backup = self.dir / f"state.v{old}.safetensors"
        if not backup.exists():
            shutil.copy2(self.path, backup)
            fsync_dir(self.dir)
            log.warning("state in %s migrated from format %d to %d; the original is kept as %s",
                        self.dir, old, FORMAT_VERSION, backup.name)

    def _remove_stale_temps(self) -> None:
        """Delete temp files a killed save left behind (one writer per state dir: `StateLock`)."""
        if self.dir.is_dir():
            for tmp in self.dir.glob(f".{STATE_FILE}.*.tmp"):
                tmp.unlink(missing_ok=True)

    def load(self) -> dict[str, dict[str, Any]]:
        """The stored sections ({} when nothing was saved yet), migrated to the current format.

        Raises StateError if the file is unreadable or was written by a newer rewardstack.
        """
        self._remove_stale_temps()
        if not self.path.exists():
            return {}
        try:
            tensors = load_file(self.path)
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                meta = f.metadata() or {}
            body = tensors.pop(_JSON_KEY, None)
            doc = json.loads(body.numpy().tobytes().decode("utf-8") if body is not None else meta.get(_JSON_KEY, "{}"))
        except (SafetensorError, OSError, ValueError) as e:
            raise StateError(f"cannot read state file {self.path}: {e}") from e
        version = doc.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise StateError(f"state file {self.path} has an invalid format version {version!r}")
        if version > FORMAT_VERSION:
            raise StateError(
                f"state file {self.path} was written by a newer rewardstack (state format {version}; this "
                f"version reads formats up to {FORMAT_VERSION}). Upgrade rewardstack or set another state_dir; "
                "the file was not changed."
            )
        sections: dict[str, dict[str, Any]] = {s: dict(v) for s, v in doc.get("sections", {}).items()}
        for name, t in tensors.items():
            section, _, key = name.partition("/")
            sections.setdefault(section, {})[key] = t
        # Formats 1 and 2 hold the sections of format 3 (which moved the JSON into the body, read
        # above): nothing to convert; the first save writes format 3 and keeps the original.
        self.loaded_version = version
        return sections


class StateLock:
    """An exclusive lock on a state directory (`fcntl.flock` on `<dir>/lock`), held until `release`.

    Only one process may write a state directory at a time: a second `acquire` (from another
    process, or another `StateLock` in this one) raises `StateLockedError` at once, naming the pid
    that holds it. The kernel drops the lock when its holder dies, so a killed run never leaves a
    stale lock behind.
    """

    def __init__(self, state_dir: str | Path, *, name: str = LOCK_FILE) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / name  # another file name: the same lock on another kind of folder
        self._fd: int | None = None

    def acquire(self) -> "StateLock":
        """Take the lock or raise StateLockedError."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateError(f"cannot lock state directory {self.dir}: {e}") from e
            who = f"process {holder}" if holder else "another process"
            raise StateLockedError(
                f"state directory {self.dir} is in use by {who} (lock {self.path}); only one process may "
                "write a state directory at a time: wait for it to finish or use another state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing the descriptor releases the flock
                self._fd = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def __enter__(self) -> "StateLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
