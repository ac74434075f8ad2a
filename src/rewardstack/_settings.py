"""Settings tables of the config file that features add: `[memory]`, `[telemetry]`, `[service]`, `[input]`.

Each table is a pydantic model on `Table`: a setting is one annotated line, its checks in `Field`
(`queue_size: int = Field(64, gt=0)`), and the docstring under it, the help `rewardstack config
--explain` prints. `parse_table` validates a TOML table against one: an unknown key is an error naming
the closest valid key, and a value of the wrong type names its key (`ConfigError`). `Bytes` settings
accept an integer or a size string ("40GiB", "512MiB"). Command-line flags override what a table sets
(each command says which).
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Iterable, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from rewardstack.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def _size(value: Any) -> int:
    """Bytes from an integer or a size string: `1073741824`, `"512MiB"`, `"40GiB"`, `"1.5 GB"` (ValueError)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if m and m.group(2).lower() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"must be a number of bytes or a size such as '40GiB' or '512MiB', got {value!r}")


BYTES = BeforeValidator(_size)
Bytes = Annotated[int, BYTES, Field(gt=0)]
"""A positive number of bytes: an integer, or a size string in TOML and on the command line."""
_BYTES: TypeAdapter[int] = TypeAdapter(Bytes)


def closest(key: str, valid: Iterable[str]) -> str:
    """' (did you mean `x`?)' for the closest valid key, or '' when nothing is close."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def unknown_key_error(prefix: str, key: str, valid: Iterable[str]) -> ConfigError:
    """The error for a key a table does not declare: names it, the closest valid one, and all."""
    valid = sorted(valid)
    return ConfigError(f"{prefix}{key}", f"unknown key{closest(key, valid)}; valid keys: {', '.join(valid)}")


# pydantic's error types, said as today's messages ("must be an integer, got 'x'"); any other type
# keeps pydantic's own message, "Input should be" read as "must be".
_PROBLEMS = {"int_type": "an integer", "bool_type": "true or false", "float_type": "a number", "string_type": "a string",
             "list_type": "a list", "dict_type": "a table", "greater_than": "more than {gt}", "greater_than_equal":
             "at least {ge}", "less_than_equal": "at most {le}", "finite_number": "a finite number",
             "too_short": "at least {min_length} items long", "too_long": "at most {max_length} items long",
             "string_pattern_mismatch": "a non-empty string"}


def config_error(err: ValidationError, prefix: str, valid: Iterable[str] = ()) -> ConfigError:
    """pydantic's first error as the ConfigError naming its key, `prefix.key` (`valid`: the keys an
    unknown key is compared with)."""
    e = err.errors(include_url=False)[0]
    name = str(e["loc"][0]) if e["loc"] else ""
    key = ".".join(part for part in (prefix, name) if part)
    if e["type"] == "extra_forbidden":
        return unknown_key_error(f"{prefix}." if prefix else "", name, valid)
    if e["type"] == "value_error":  # a validator's own message, which names the value
        return ConfigError(key, str(e["ctx"]["error"]))
    ctx = e.get("ctx", {})
    if ctx == {"gt": 0}:
        text = "must be positive"
    elif e["type"] in _PROBLEMS:
        text = "must be " + _PROBLEMS[e["type"]].format(**ctx)
    else:
        text = e["msg"].replace("Input should be", "must be")
    return ConfigError(key, f"{text}, got {e['input']!r}")


def parse_bytes(value: int | str, *, key: str = "<bytes>") -> int:
    """Bytes from an integer or a size string (a command-line flag's): errors name `key`."""
    try:
        return _BYTES.validate_python(value, strict=True)
    except ValidationError as e:
        raise config_error(e, key) from None


class Table(BaseModel):
    """A table of the config file: unknown keys refused, TOML's types taken as they are (a bool is no
    number, "8" no integer), the docstring under each field its help."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


T = TypeVar("T", bound=BaseModel)


def parse_table(cls: type[T], raw: Any, prefix: str) -> T:
    """Validate the TOML table `raw` (under `[prefix]`) into the model `cls`."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(prefix, "must be a table")
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise config_error(e, prefix, cls.model_fields) from None


class MemorySettings(Table):
    """`[memory]`: how the card is sized and how cost models are kept."""

    device_memory: Bytes | None = None
    """Behave as on a card of this size (e.g. "40GiB"): budget, placement and a hard cap on CUDA; on CPU the simulated device's size. Unset: the real card (CUDA) or `memory_budget` (CPU)."""
    calibration_file: str | None = None
    """The calibration cache: fitted cost models reused at start (relative to the config file). Unset: $REWARDSTACK_HOME/calibration/cache.json (rewardstack._paths), one for every config, its fits keyed by checkpoint content; none for a config built in code."""


class TelemetrySettings(Table):
    """`[telemetry]`: the run directory, its size cap, metrics and alarms."""

    run_dir: str | None = None
    """Folder for timeline.jsonl, events.jsonl, incidents/ and summary.json (relative to the config file). Unset: no run directory unless a command's --run-dir gives one (a bare --run-dir: a new folder under $REWARDSTACK_HOME/<config stem>-<hash>/runs)."""
    max_bytes: Bytes = 256 * 1024**2
    """Cap on the run directory's timeline and incidents together (rotated, oldest first); the events are never dropped."""
    keep_incidents: int = Field(50, gt=0)
    """OOM incident records kept (the newest)."""
    keep_snapshots: int = Field(3, gt=0)
    """CUDA allocator snapshots kept beside the incident records (the newest; each can be large)."""
    history_entries: int = 0
    """CUDA only: allocation-history entries PyTorch records for the incident snapshots (a ring buffer, never unbounded). 0: off."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port while scoring (--metrics-port overrides). Unset: no endpoint."""
    leak_window: int = Field(100, ge=2)
    """Steps in the sliding window of memory at rest that the leak and fragmentation alarms fit a slope to."""
    leak_warmup: int = 10
    """First steps left out of the alarms (caches fill then)."""
    leak_bytes_per_step: Bytes = 1024**2
    """Device bytes allocated at rest: a slope above this many bytes per step raises the leak alarm."""
    host_leak_bytes_per_step: Bytes = 4 * 1024**2
    """Process RSS at rest (declared bounded growth subtracted): a slope above this raises the leak alarm."""
    fragmentation_bytes_per_step: Bytes = 4 * 1024**2
    """CUDA reserved minus allocated at rest: a slope above this raises the fragmentation alarm."""


class ServiceSettings(Table):
    """`[service]`: `rewardstack serve`'s address and limits."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires a bearer token."""
    port: int = Field(8000, gt=0)
    """TCP port."""
    max_body_bytes: Bytes = 4 * 1024**2
    """Largest request body, counted as the bytes arrive (a Content-Length header is not trusted); larger is 413."""
    max_completions: int = Field(256, gt=0)
    """Most completions in one step; more is 413 (before any tokenization)."""
    max_chars: int = Field(65536, gt=0)
    """Most characters in one completion, prompt or base prompt; more is 413 (before any tokenization)."""
    queue_size: int = Field(64, gt=0)
    """Steps that may wait for the scoring worker; a full queue answers 429 with Retry-After."""
    deadline_s: float = Field(60.0, gt=0)
    """Seconds a request may wait for the worker to start it; past that it is not scored (504). Once started, a step always commits."""
    batch_requests: int = Field(16, gt=0)
    """Most queued requests the worker takes together: forward passes model by model, each namespace committed once (1: one at a time)."""
    max_namespaces: int = Field(64, gt=0)
    """Most namespaces (clients with their own state); a request for a new one past this is 403."""
    tokens_file: str | None = None
    """TOML table of token SHA-256 hex digest -> namespace the token may use (relative to the config file). $REWARDSTACK_TOKEN is a token for every namespace."""
    max_work_chars: int = Field(1024**2, gt=0)
    """Most work one request may ask, in characters the models read: each live completion with its prompt (and its base prompt when given); more is 413 before tokenizing. A turn of the worker takes at most this much too, so another namespace's request waits for at most one such turn."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds a connection may take to send a request's headers (from connecting, or from its previous answer); slower is closed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds a request may take to send its whole body; slower is answered 408 and its connection closed."""
    max_connections: int = Field(8192, gt=0)
    """Most open connections; more are closed as they arrive (the cap is also kept 64 under the process's open-file limit). The default holds a trainer's burst of 4,096 one-connection requests (OpenRLHF opens a session per request)."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """Seconds a shutdown (SIGTERM) waits for open requests before closing them; a step already started still commits."""
    batch_wait_s: float = Field(0.005, ge=0)
    """Trainer routes (/get_reward, /classify): the longest a request waits for others to share its forward passes (requests that arrive while the worker is busy batch anyway)."""
    slice_tokens: int = Field(0, ge=0)
    """Trainer routes: most tokens one slice of trainer work holds (inputs of many requests; a large request spans slices). A validator's step waits for at most one slice. 0: one full pass of each served [rewards.*] model (their pass sizes summed)."""
    stateless_queue: int = Field(65536, gt=0)
    """Trainer routes: most requests waiting for the worker; more is 429 with Retry-After (apart from the validators' queue_size)."""
    trainer_deadline_s: float = Field(600.0, gt=0)
    """Trainer routes: seconds a request may wait for its first slice; past that it is not scored (504). Longer than `deadline_s`: a trainer's burst is drained whole, and a client that gives up first withdraws its request."""
    max_queued_tokens: int = Field(16 * 1024**2, gt=0)
    """Trainer routes: most tokens waiting for the worker, counted per model after tokenizing (4 bytes each held); a request past it is 429 with Retry-After. The default holds a burst of 4,096 requests of 4,096 tokens."""


class InputSettings(Table):
    """`[input]`: the most work one step may ask of the stack (library, `score`, `replay`)."""

    max_chars: int = Field(65536, gt=0)
    """Most characters of a prompt, base prompt or completion the models read; past it the text is cut before tokenizing and the completion's status is `cut` (docs/SEMANTICS.md). --max-chars overrides."""
    max_completions: int = Field(256, gt=0)
    """Most completions in one step; a step with more is refused as bad input naming `completions`. --max-completions overrides."""


TABLES: dict[str, type[Table]] = {"memory": MemorySettings, "telemetry": TelemetrySettings, "service": ServiceSettings,
                           "input": InputSettings}
