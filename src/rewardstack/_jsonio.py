"""Reading untrusted JSON lines and bodies: bytes are decoded per line, nesting is bounded.

Every reader of input a user or a client controls (`rewardstack score`'s step file, replay's run
logs, the HTTP service's request bodies) parses through `parse`, so a bad line is an `InputError`
that names it, never a traceback that stops the run:

- bytes that are not UTF-8 name the offending byte and its column (the other lines still read);
- text that is not JSON names the parser's message and column;
- nesting deeper than `MAX_DEPTH` levels (objects and arrays) is refused. Python's `json` recurses
  on nesting and raises `RecursionError` near 1,000 levels; worse, a document just under that
  parses and then breaks every recursive consumer after it (the event writer, `json.dumps`). No
  step needs more than a few levels, so 64 is far from any real input and far from the limit.

A key that appears twice in one object is refused (`json` would keep the last one silently, so
what a reader scores and what the writer meant could differ without a word).

`strict=True` also refuses the bare `NaN` / `Infinity` constants Python's `json` accepts (they are
not JSON); the step file keeps accepting them because the validator's own logs hold them.

`canonical_chunks` is the other direction, for hashing what was read (`runner.step_hash`): the
bytes of the canonical `json.dumps`, in pieces, so a huge string is never serialized whole.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from rewardstack.errors import InputError, json_error_message

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
        raise JSONInputError(json_error_message(e), "syntax", line=line) from None
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


__all__ = ["JSONInputError", "MAX_DEPTH", "exceeds_depth", "parse"]


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
