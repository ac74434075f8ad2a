"""Line-oriented I/O and committed files: strict-JSON values, event lines, step lines, one atomic write.

Everything here sits below the stack and the commands, so that library code (the runner, replay,
the service) never has to reach into the command line for how a line is written:

- `jsonable(x)`: strict JSON values (NaN and infinities, i.e. unscored values, become null; keys
  become strings), and `event_line(event)`: one event as a JSONL line.
- `read_steps(lines)`: (line number, parsed object or the `InputError` saying what is wrong).
- `progress(total, desc)`: the progress bar the scoring commands show on stderr.
- `atomic_write` / `atomic_write_bytes` / `atomic_write_text`: the one way the package commits a
  file. A temporary file in the same folder is written, flushed and fsynced, renamed over the
  target, and the folder is fsynced: a reader (or a process started after a kill or a power cut)
  sees the old file or the new one, never a mix, and never loses the rename.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from rewardstack.errors import InputError

log = logging.getLogger("rewardstack.fileio")

BOM = "\ufeff"
"""The byte order mark some editors (Windows Notepad) put at the start of a UTF-8 file."""


def jsonable(x: Any) -> Any:
    """Strict JSON values: NaN and infinities (unscored values) become null; keys become strings.

    Iterative, not recursive: a step's free-form fields (`set_weights`) reach the event as given,
    and a recursive walk of a deeply nested value would raise RecursionError on every rerun.
    """
    def convert(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            out: Any = {}
        elif isinstance(v, (list, tuple)):
            out = []
        else:
            return v
        todo.append((v, out))
        return out

    todo: list[tuple[Any, Any]] = []
    root = convert(x)
    while todo:
        src, dst = todo.pop()
        if isinstance(src, dict):
            for k, v in src.items():
                dst[str(k)] = convert(v)
        else:
            dst.extend(convert(v) for v in src)
    return root


def event_line(event: dict[str, Any]) -> str:
    """One event as a JSONL line (strict JSON, UTF-8 kept readable)."""
    return json.dumps(jsonable(event), ensure_ascii=False, allow_nan=False) + "\n"


def is_blank(line: str | bytes) -> bool:
    """Whether a line holds only whitespace (without `strip()`'s copy of a 50 MB line)."""
    return not line or line.isspace()


def read_steps(lines: Iterable[str | bytes]) -> Iterator[tuple[int, dict[str, Any] | InputError]]:
    """(line number, parsed object or the InputError that says what is wrong), skipping blanks.

    Lines may be bytes (a file opened in binary): each is decoded on its own, so a line that is
    not UTF-8 is that line's error and the others are read (rewardstack._jsonio). A byte order mark
    at the start of the first line is skipped, with one warning: it marks the file's encoding and is
    no part of the first step (JSON itself refuses it).

    Memory: only the parsed object outlives the read. The raw line is dropped before the JSON
    parse, whose text is dropped on return, so reading a 50 MB line holds two copies at a time,
    never three; and the line number is counted here rather than by `enumerate`, whose reused
    result tuple keeps the last raw line alive while its step is scored.
    """
    from rewardstack._jsonio import decode_line, parse

    number = 0
    for line in lines:
        number += 1
        if is_blank(line):
            continue
        try:
            text = decode_line(line, line=number)
            del line
            if number == 1 and text.startswith(BOM):
                log.warning("line 1 starts with a UTF-8 byte order mark (U+FEFF); it is skipped")
                text = text[len(BOM):]
                if is_blank(text):
                    continue
            obj = parse(text, line=number)
        except InputError as e:
            yield number, e
            continue
        del text
        yield number, obj


def progress(total: int | None, desc: str) -> Any:
    """A progress bar on stderr, counted in steps (off when stderr is not a terminal)."""
    from tqdm import tqdm  # only the commands that show one pay for the import

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None)


def default_mode() -> int:
    """The permissions a plain `open()` would give a new file under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], *, prefix: str | None = None,
                 mode: int | None = None) -> Path:
    """Commit a file: `write(f)` fills a temporary file beside `path`, which then replaces `path`.

    The temporary file is named `prefix` + random + `.tmp` (default prefix `.NAME.`), so a folder's
    owner can sweep the leftovers of a killed writer by that pattern. `mode` sets its permissions
    (default: what `open()` would give under the umask; mkstemp alone makes 0600). On any error the
    temporary file is removed and `path` is untouched. Returns `path`.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix if prefix is not None else f".{target.name}.", suffix=".tmp",
                               dir=target.parent)
    try:
        os.fchmod(fd, default_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, **kwargs: Any) -> Path:
    """Commit `data` as the file `path` (see `atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data), **kwargs)


def atomic_write_text(path: str | os.PathLike[str], text: str, **kwargs: Any) -> Path:
    """Commit `text`, UTF-8, as the file `path` (see `atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), **kwargs)


def atomic_write_json(path: str | os.PathLike[str], doc: Any, *, indent: int | None = 1, **kwargs: Any) -> Path:
    """Commit `doc` as strict JSON (NaN as null), UTF-8 kept readable (see `atomic_write`)."""
    text = json.dumps(jsonable(doc), ensure_ascii=False, indent=indent, allow_nan=False)
    return atomic_write_text(path, text, **kwargs)


def merge_json_section(path: str | os.PathLike[str], section: str, value: Any) -> Path:
    """Set `section` of the JSON object in `path` to `value` (strict JSON), keeping its other sections.

    How `replay` and `soak` each add their part to a run directory's `summary.json`: a file that is
    missing or unreadable counts as empty; the result is committed atomically.
    """
    target = Path(path)
    doc: dict[str, Any] = {}
    if target.exists():
        try:
            loaded = json.loads(target.read_text(encoding="utf-8"))
            doc = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            doc = {}
    doc[section] = jsonable(value)
    return atomic_write_json(target, doc)
