"""Runs of an archive for `rewardstack rescore`: what one unit of work is and how its steps are read.

A run is what `replay` calls one: a parquet file, a step or event JSONL file, or a validator log
(`completions.log`, or the folder holding it with its rotated siblings). It is scored in order by one
stack from fresh state, because normalization is stateful within a run. Steps are read through
`rewardstack._replay.readers` (in the worker). Nothing here imports Ray.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rewardstack.errors import InputError

RUN_SUFFIXES = (".parquet", ".jsonl", ".log", ".log.gz", ".log.zip")
"""Files a folder argument expands to, one run each (a folder holding `completions.log` is one run)."""


@dataclass(frozen=True)
class Run:
    """One unit of re-scoring work: an input (file or validator log folder) and its output name."""

    path: str
    """Absolute path of the run's file or folder."""
    id: str
    """Stable name of its output (`<stem>-<8 hex of the path>`), unique within one archive."""
    files: tuple[str, ...] = field(default=())
    """Every file the run reads (a log folder's rotated siblings included)."""

    def size(self) -> int:
        """Bytes of input (how long the run takes, roughly); 0 if a file is gone."""
        try:
            return sum(os.stat(f).st_size for f in self.files)
        except OSError:
            return 0

    def fingerprint(self) -> list[list[object]]:
        """(name, size, mtime_ns) of every file: a changed input is not 'already complete'."""
        return [[f, st.st_size, st.st_mtime_ns] for f, st in zip(self.files, map(os.stat, self.files))]


def make_run(path: str | Path) -> Run:
    """The run at `path` (a file, or a validator log folder); raises InputError if it is neither."""
    p = Path(path).resolve()
    if p.is_dir():
        files = sorted(str(f) for f in p.glob("completions*.log*") if f.is_file())
        if not files:
            raise InputError(f"{p} is a folder without a completions.log; pass its runs as files")
    elif p.is_file():
        files = [str(p)]
    else:
        raise InputError(f"{p}: no such run (file or validator log folder)")
    stem = p.name.split(".")[0] or "run"
    digest = hashlib.sha256(str(p).encode()).hexdigest()[:8]
    return Run(path=str(p), id=f"{stem}-{digest}", files=tuple(files))


def discover_runs(paths: Sequence[str | Path], *, list_files: Sequence[str | Path] = ()) -> list[Run]:
    """Runs named on the command line, in order, each once.

    A file is one run; a folder holding `completions.log` is one run (the log with its rotated
    siblings); any other folder stands for each run file directly inside it (sorted). `list_files`
    are text files of run paths, one per line (an archive of 100,000 runs does not fit in argv).
    """
    names: list[Path] = [Path(p) for p in paths]
    for lf in list_files:
        text = Path(lf).read_text(encoding="utf-8")
        names += [Path(line.strip()) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    runs: list[Run] = []
    seen: set[str] = set()
    for p in names:
        if p.is_dir() and not any(p.glob("completions*.log*")):  # not a validator log folder
            members = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(RUN_SUFFIXES))
            if not members:
                raise InputError(f"{p} holds no runs (files ending in {', '.join(RUN_SUFFIXES)})")
            candidates = [make_run(f) for f in members]
        else:
            candidates = [make_run(p)]
        for run in candidates:
            if run.path not in seen:
                seen.add(run.path)
                runs.append(run)
    return runs

