"""Line-oriented I/O and committed files: untrusted JSON read safely, strict-JSON values, event lines,
step lines, one atomic write.

Everything here sits below the stack and the commands, so that library code (the runner, replay,
the service) never has to reach into the command line for how a line is written:

- `jsonable(x)`: strict JSON values (NaN and infinities, i.e. unscored values, become null; keys
  become strings), and `event_line(event)`: one event as a JSONL line.
- `read_steps(lines)`: (line number, parsed object or the `InputError` saying what is wrong).
- `progress(total, desc)`: the progress bar the scoring commands show on stderr.
- `sha256_of(path)`: a file's hex sha256 (the calibration cache's checkpoint digests, the real
  checkpoints' checks in `bench/realmodels.py`).
- `atomic_write` / `atomic_write_bytes` / `atomic_write_text`: the one way the package commits a
  file. A temporary file in the same folder is written, flushed and fsynced, renamed over the
  target, and the folder is fsynced: a reader (or a process started after a kill or a power cut)
  sees the old file or the new one, never a mix, and never loses the rename.
- `parse(line)`: every reader of input a user or a client controls (`rewardstack score`'s step
  file, replay's run logs, the HTTP service's request bodies) parses through it, so a bad line is
  an `InputError` that names it, never a traceback that stops the run: bytes that are not UTF-8
  name the offending byte and its column (the other lines still read); text that is not JSON
  names the parser's message and column; nesting deeper than `MAX_DEPTH` levels is refused
  (Python's `json` recurses on nesting and raises `RecursionError` near 1,000 levels, and a
  document just under that breaks every recursive consumer after it; no step needs more than a
  few levels, so 64 is far from any real input and far from the limit); a key that appears twice
  in one object is refused (`json` would keep the last one silently, so what a reader scores and
  what the writer meant could differ without a word). `strict=True` also refuses the bare `NaN` /
  `Infinity` constants Python's `json` accepts; the step file keeps accepting them because the
  validator's own logs hold them.
- `canonical_chunks`: the other direction, for hashing what was read (`runner.step_hash`): the
  bytes of the canonical `json.dumps`, in pieces, so a huge string is never serialized whole.
"""

from __future__ import annotations

import hashlib
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
    not UTF-8 is that line's error and the others are read (rewardstack._fileio). A byte order mark
    at the start of the first line is skipped, with one warning: it marks the file's encoding and is
    no part of the first step (JSON itself refuses it).

    Memory: only the parsed object outlives the read. The raw line is dropped before the JSON
    parse, whose text is dropped on return, so reading a 50 MB line holds two copies at a time,
    never three; and the line number is counted here rather than by `enumerate`, whose reused
    result tuple keeps the last raw line alive while its step is scored.
    """
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


def sha256_of(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


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


# -- reading untrusted JSON ------------------------------------------------------------------------
MAX_DEPTH = 64
"""Deepest nesting of objects and arrays a step (or request body) may have."""


class JSONInputError(InputError):
    """Input that is not a JSON document this package reads; `reason` is utf8, syntax or depth."""

    def __init__(self, message: str, reason: str, *, line: int | None = None, field: str | None = None) -> None:
        super().__init__(message, line=line, field=field)
        self.reason = reason


def exceeds_depth(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `obj` nests objects/arrays deeper than `limit` levels (iterative: any depth is safe)."""
    todo: list[tuple[Any, int]] = [(obj, 1)]
    while todo:
        x, depth = todo.pop()
        if isinstance(x, dict):
            children: Any = x.values()
        elif isinstance(x, (list, tuple)):
            children = x
        else:
            continue
        if depth > limit:
            return True
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _DuplicateKey(ValueError):
    """A key seen twice in one object (raised from inside `json.loads`, caught by `parse`)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # the common case costs one length comparison
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def decode_line(data: str | bytes, *, line: int | None = None) -> str:
    """`data` as text (bytes are decoded as UTF-8), or a JSONInputError naming the first bad byte."""
    if not isinstance(data, (bytes, bytearray)):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONInputError(f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})", "utf8",
                             line=line) from None


def parse(data: str | bytes, *, line: int | None = None, strict: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """One JSON document from `data` (bytes are decoded as UTF-8), or a JSONInputError naming why not."""
    text = decode_line(data, line=line)
    try:
        obj = json.loads(text, parse_constant=_refuse_constant if strict else None, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        # The column within the error's own line, never the column after its line break: `json` puts an
        # error at the end of a line (an unclosed object) at column 1 of the next.
        own = text.rstrip("\r\n")
        column = min(e.pos, len(own)) - own.rfind("\n", 0, e.pos)
        # Some of json's messages end in "at" ("Invalid control character at"): said once here.
        raise JSONInputError(f"not valid JSON ({e.msg.removesuffix(' at')} at column {column})", "syntax",
                             line=line) from None
    except _DuplicateKey as e:
        key = json.dumps(str(e.args[0])[:40], ensure_ascii=False)
        raise JSONInputError(f"not valid JSON (duplicate key {key}: a key may appear once in an object)", "syntax",
                             line=line) from None
    except ValueError as e:  # a refused constant (strict)
        raise JSONInputError(f"not valid JSON ({e})", "syntax", line=line) from None
    except RecursionError:
        raise JSONInputError(f"nested deeper than {max_depth} levels", "depth", line=line) from None
    if exceeds_depth(obj, max_depth):
        raise JSONInputError(f"nested deeper than {max_depth} levels", "depth", line=line)
    return obj


SLICE_CHARS = 1 << 20
"""Characters of a long string serialized at a time by `canonical_chunks`."""


def canonical_chunks(obj: Any, *, slice_chars: int = SLICE_CHARS) -> Iterator[bytes]:
    """`json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))` in UTF-8
    (surrogates passed), byte for byte, in pieces: a string longer than `slice_chars` is escaped
    and encoded a slice at a time, so hashing a 50 MB completion needs a slice's memory, not
    three copies of the text. Exact because JSON escapes each code point on its own (a slice
    boundary never splits an escape), and everything else is `json.dumps`'s own output. Nesting
    is what `parse` admits (MAX_DEPTH), so the recursion is bounded.
    """
    def small(x: Any) -> bytes:
        return json.dumps(x, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")

    if isinstance(obj, str):
        if len(obj) <= slice_chars:
            yield small(obj)
            return
        yield b'"'
        for i in range(0, len(obj), slice_chars):
            yield small(obj[i:i + slice_chars])[1:-1]
        yield b'"'
    elif isinstance(obj, (list, tuple)):
        yield b"["
        for k, v in enumerate(obj):
            if k:
                yield b","
            yield from canonical_chunks(v, slice_chars=slice_chars)
        yield b"]"
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        yield b"{"
        for k, (key, v) in enumerate(sorted(obj.items(), key=lambda kv: kv[0])):
            if k:
                yield b","
            yield small(key) + b":"
            yield from canonical_chunks(v, slice_chars=slice_chars)
        yield b"}"
    else:  # numbers, booleans, null; a dict with non-string keys (json.dumps converts and sorts them)
        yield small(obj)
