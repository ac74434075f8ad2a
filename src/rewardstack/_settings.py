"""Settings tables of the config file that features add: `[memory]`, `[telemetry]`, `[service]`, `[input]`.

Each table is a dataclass; its fields' docstrings (the string literal under each field, `field_docs`) are
the help that `rewardstack config --explain` prints. `parse_table` validates a TOML table against one:
an unknown key is an error naming the closest valid key, and a value of the wrong type names its
key. Fields whose metadata says `bytes` accept an integer or a size string ("40GiB", "512MiB").
Command-line flags override what a table sets (each command says which).
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
import sys
import types
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

from rewardstack.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | str, *, key: str = "<bytes>") -> int:
    """Bytes from an integer or a size string: `1073741824`, `"512MiB"`, `"40GiB"`, `"1.5 GB"`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif m and m.group(2).lower() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(key, f"must be a number of bytes or a size such as '40GiB' or '512MiB', got {value!r}")
    if n <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    return n


def closest(key: str, valid: typing.Iterable[str]) -> str:
    """' (did you mean `x`?)' for the closest valid key, or '' when nothing is close."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def unknown_key_error(prefix: str, key: str, valid: typing.Iterable[str]) -> ConfigError:
    """The error for a key a table does not declare: names it, the closest valid one, and all."""
    valid = sorted(valid)
    return ConfigError(f"{prefix}{key}", f"unknown key{closest(key, valid)}; valid keys: {', '.join(valid)}")


@functools.lru_cache(maxsize=None)
def _module_tree(filename: str) -> ast.Module:
    with open(filename, encoding="utf-8") as f:
        return ast.parse(f.read(), filename)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the help line of that setting).

    Read from the class's module file with `ast` (parsed once per file): `inspect.getsource` costs a
    tenth of a second, which `rewardstack --help` would pay for its `serve` flags.
    """
    tree = _module_tree(sys.modules[cls.__module__].__file__)
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(value: Any, hint: Any, key: str, is_bytes: bool) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if is_bytes:
        return parse_bytes(value, key=key)
    if hint in _KINDS:  # a bool is no number here, though Python's bool is an int
        accepted = (int, float) if hint is float else hint
        if isinstance(value, bool) != (hint is bool) or not isinstance(value, accepted):
            raise ConfigError(key, f"must be {_KINDS[hint]}, got {value!r}")
        return float(value) if hint is float else value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list, got {value!r}")
        return [_check_type(v, args[0], key, False) for v in value] if args else value
    return value


def check_value(f: Field, hint: Any, value: Any, key: str) -> Any:
    """`value` of the dataclass field `f` (type `hint`) checked: its type, then its metadata's `check`."""
    v = _check_type(value, hint, key, bool(f.metadata.get("bytes")))
    check = f.metadata.get("check")
    problem = check(v) if check is not None and v is not None else None
    if problem:
        raise ConfigError(key, problem)
    return v


T = TypeVar("T")


def parse_table(cls: type[T], raw: Any, prefix: str) -> T:
    """Validate the TOML table `raw` (under `[prefix]`) into the dataclass `cls`."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(prefix, "must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise unknown_key_error(f"{prefix}.", key, known)
        values[key] = check_value(known[key], hints[key], value, f"{prefix}.{key}")
    return cls(**values)


def positive(v: Any) -> str | None:
    return None if v > 0 else f"must be positive, got {v!r}"


def byte_field(default: int | None, **meta: Any) -> Any:
    """A setting in bytes: an integer or a size string in TOML."""
    return field(default=default, metadata={"bytes": True, **meta})


@dataclass
class MemorySettings:
    """`[memory]`: how the card is sized and how cost models are kept."""

    device_memory: int | None = byte_field(None)
    """Behave as on a card of this size (e.g. "40GiB"): budget, placement and a hard cap on CUDA; on CPU the simulated device's size. Unset: the real card (CUDA) or `memory_budget` (CPU)."""
    calibration_file: str | None = None
    """The calibration cache: fitted cost models reused at start (relative to the config file). Unset: $REWARDSTACK_HOME/calibration/cache.json (rewardstack._paths), one for every config, its fits keyed by checkpoint content; none for a config built in code."""


@dataclass
class TelemetrySettings:
    """`[telemetry]`: the run directory, its size cap, metrics and alarms."""

    run_dir: str | None = None
    """Folder for timeline.jsonl, events.jsonl, incidents/ and summary.json (relative to the config file). Unset: no run directory unless a command's --run-dir gives one (a bare --run-dir: a new folder under $REWARDSTACK_HOME/<config stem>-<hash>/runs)."""
    max_bytes: int = byte_field(256 * 1024**2, check=positive)
    """Cap on the run directory's timeline and incidents together (rotated, oldest first); the events are never dropped."""
    keep_incidents: int = field(default=50, metadata={"check": positive})
    """OOM incident records kept (the newest)."""
    keep_snapshots: int = field(default=3, metadata={"check": positive})
    """CUDA allocator snapshots kept beside the incident records (the newest; each can be large)."""
    history_entries: int = 0
    """CUDA only: allocation-history entries PyTorch records for the incident snapshots (a ring buffer, never unbounded). 0: off."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port while scoring (--metrics-port overrides). Unset: no endpoint."""
    leak_window: int = field(default=100, metadata={"check": lambda v: None if v >= 2 else f"must be at least 2, got {v!r}"})
    """Steps in the sliding window of memory at rest that the leak and fragmentation alarms fit a slope to."""
    leak_warmup: int = 10
    """First steps left out of the alarms (caches fill then)."""
    leak_bytes_per_step: int = byte_field(1024**2)
    """Device bytes allocated at rest: a slope above this many bytes per step raises the leak alarm."""
    host_leak_bytes_per_step: int = byte_field(4 * 1024**2)
    """Process RSS at rest (declared bounded growth subtracted): a slope above this raises the leak alarm."""
    fragmentation_bytes_per_step: int = byte_field(4 * 1024**2)
    """CUDA reserved minus allocated at rest: a slope above this raises the fragmentation alarm."""


@dataclass
class ServiceSettings:
    """`[service]`: `rewardstack serve`'s address and limits."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires a bearer token."""
    port: int = field(default=8000, metadata={"check": positive})
    """TCP port."""
    max_body_bytes: int = byte_field(4 * 1024**2, check=positive)
    """Largest request body, counted as the bytes arrive (a Content-Length header is not trusted); larger is 413."""
    max_completions: int = field(default=256, metadata={"check": positive})
    """Most completions in one step; more is 413 (before any tokenization)."""
    max_chars: int = field(default=65536, metadata={"check": positive})
    """Most characters in one completion, prompt or base prompt; more is 413 (before any tokenization)."""
    queue_size: int = field(default=64, metadata={"check": positive})
    """Steps that may wait for the scoring worker; a full queue answers 429 with Retry-After."""
    deadline_s: float = field(default=60.0, metadata={"check": positive})
    """Seconds a request may wait for the worker to start it; past that it is not scored (504). Once started, a step always commits."""
    batch_requests: int = field(default=16, metadata={"check": positive})
    """Most queued requests the worker takes together: forward passes model by model, each namespace committed once (1: one at a time)."""
    max_namespaces: int = field(default=64, metadata={"check": positive})
    """Most namespaces (clients with their own state); a request for a new one past this is 403."""
    tokens_file: str | None = None
    """TOML table of token SHA-256 hex digest -> namespace the token may use (relative to the config file). $REWARDSTACK_TOKEN is a token for every namespace."""
    max_work_chars: int = field(default=1024**2, metadata={"check": positive})
    """Most work one request may ask, in characters the models read: each live completion with its prompt (and its base prompt when given); more is 413 before tokenizing. A turn of the worker takes at most this much too, so another namespace's request waits for at most one such turn."""
    header_timeout_s: float = field(default=10.0, metadata={"check": positive})
    """Seconds a connection may take to send a request's headers (from connecting, or from its previous answer); slower is closed."""
    body_timeout_s: float = field(default=30.0, metadata={"check": positive})
    """Seconds a request may take to send its whole body; slower is answered 408 and its connection closed."""
    max_connections: int = field(default=256, metadata={"check": positive})
    """Most open connections; more are closed as they arrive (the cap is also kept 64 under the process's open-file limit)."""
    drain_timeout_s: float = field(default=30.0, metadata={"check": positive})
    """Seconds a shutdown (SIGTERM) waits for open requests before closing them; a step already started still commits."""
    batch_wait_s: float = field(default=0.005, metadata={"check": lambda v: None if v >= 0 else f"must be >= 0, got {v!r}"})
    """Trainer routes (/get_reward, /classify): the longest a request waits for others to share its forward passes (requests that arrive while the worker is busy batch anyway)."""
    slice_tokens: int = field(default=0, metadata={"check": lambda v: None if v >= 0 else f"must be >= 0, got {v!r}"})
    """Trainer routes: most tokens one slice of trainer work holds (inputs of many requests; a large request spans slices). A validator's step waits for at most one slice. 0: one full pass of each served [rewards.*] model (their pass sizes summed)."""
    stateless_queue: int = field(default=65536, metadata={"check": positive})
    """Trainer routes: most requests waiting for the worker; more is 429 with Retry-After (apart from the validators' queue_size)."""
    trainer_deadline_s: float = field(default=600.0, metadata={"check": positive})
    """Trainer routes: seconds a request may wait for its first slice; past that it is not scored (504). Longer than `deadline_s`: a trainer's burst is drained whole, and a client that gives up first withdraws its request."""
    max_queued_tokens: int = field(default=16 * 1024**2, metadata={"check": positive})
    """Trainer routes: most tokens waiting for the worker, counted per model after tokenizing (4 bytes each held); a request past it is 429 with Retry-After. The default holds a burst of 4,096 requests of 4,096 tokens."""


@dataclass
class InputSettings:
    """`[input]`: the most work one step may ask of the stack (library, `score`, `replay`)."""

    max_chars: int = field(default=65536, metadata={"check": positive})
    """Most characters of a prompt, base prompt or completion the models read; past it the text is cut before tokenizing and the completion's status is `cut` (docs/SEMANTICS.md). --max-chars overrides."""
    max_completions: int = field(default=256, metadata={"check": positive})
    """Most completions in one step; a step with more is refused as bad input naming `completions`. --max-completions overrides."""


TABLES: dict[str, type] = {"memory": MemorySettings, "telemetry": TelemetrySettings, "service": ServiceSettings,
                           "input": InputSettings}
