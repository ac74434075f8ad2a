"""Public names a package loads on first use, so that importing the package stays cheap.

`rewardstack` names classes whose modules import torch; the command line's `--help` and
`import rewardstack` must not pay for that. A package declares its names and gets a module `__getattr__` and `__dir__` (PEP 562):

    __getattr__, __dir__ = lazy_names(__name__, {"RewardStack": "rewardstack.stack"})
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`: each name in `names` loads from its module once."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # kept: the next lookup is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
