"""How the `rewardstack` command ends: exit codes, one line for an ordinary mistake, checks made
before any model loads.

An ordinary mistake (a missing input, a config that does not parse, a run folder that is a file)
is told in one line on stderr and ends the command with exit code 1; `-v` adds the traceback. A
bug (any other exception) keeps Python's traceback: hiding it would hide the defect.

Exit codes (docs/SCORING.md, "Exit codes"):

- 0: every input line was scored (or the command did what it was asked);
- 2: some input lines were skipped (each named on stderr), the others scored;
- 1: the command failed (the line on stderr says why);
- 3: the command needs an optional extra that is not installed (the line names it:
  `pip install 'rewardstack[report]'`); the same code for every command.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, TextIO

from rewardstack.errors import InputError, MissingExtraError, RewardStackError

EXIT_FAILED = 1
"""The command failed; stderr says why in one line."""
EXIT_MISSING_EXTRA = 3
"""An optional dependency the command needs is not installed; stderr names the extra to install."""


def ordinary_message(exc: BaseException) -> str | None:
    """The one line an ordinary mistake is told in, or None when `exc` is a bug (keep its traceback)."""
    if isinstance(exc, RewardStackError):
        return str(exc)
    if isinstance(exc, OSError):  # a file or folder missing, not readable, not a folder, disk full
        what = exc.strerror or str(exc)
        return f"{exc.filename}: {what}" if exc.filename else what
    return None


def run_command(func: Callable[[Any], int | None], args: Any, *, verbose: int = 0, err: TextIO | None = None) -> int:
    """Run one subcommand; an ordinary mistake ends in one line and EXIT_FAILED (the traceback too with -v)."""
    err = err if err is not None else sys.stderr
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("rewardstack: interrupted", file=err)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted below: ordinary mistakes vs bugs
        # A missing extra, wherever the command imported it: one line, one exit code.
        missing = e if isinstance(e, MissingExtraError) else MissingExtraError.of(e)
        message = str(missing) if missing is not None else ordinary_message(e)
        if message is None:
            raise
        if verbose > 0:
            traceback.print_exception(e, file=err)
        print(f"rewardstack: error: {message}", file=err)
        return EXIT_MISSING_EXTRA if missing is not None else EXIT_FAILED


def check_input_file(path: str | os.PathLike[str], what: str = "--input") -> Path:
    """`path` as a readable file, or an InputError naming it (checked before any model loads)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} {p}: no such file")
    if p.is_dir():
        raise InputError(f"{what} {p}: is a folder, not a file")
    if not os.access(p, os.R_OK):
        raise InputError(f"{what} {p}: not readable")
    return p


def check_output_file(path: str | os.PathLike[str], what: str = "--output") -> None:
    """An output file can be written at `path` ('-' is stdout), or an InputError naming why not."""
    if str(path) == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {p}: is a folder, not a file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{what} {p}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{what} {p}: not writable")


def check_folder(path: str | os.PathLike[str] | None, what: str) -> None:
    """A folder that exists or can be made at `path` (None: not asked for), or an InputError."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{what} {p}: is a file, not a folder")
    if not p.exists():
        existing = next((q for q in p.absolute().parents if q.exists()), None)
        if existing is not None and not existing.is_dir():
            raise InputError(f"{what} {p}: {existing} is a file, not a folder")
        if existing is not None and not os.access(existing, os.W_OK):
            raise InputError(f"{what} {p}: cannot be made in {existing} (not writable)")


def check_run_folder(path: str | os.PathLike[str], what: str = "run folder") -> Path:
    """An existing folder to read a run from, or an InputError naming it."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} {p}: no such folder")
    if not p.is_dir():
        raise InputError(f"{what} {p}: is a file, not a folder")
    return p
