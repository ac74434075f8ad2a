"""The scorers: one module per family, each with its builders and its offline stand-ins.

The model registry (`rewardstack.models`) names, per event name of the spec, its "module:builder"
(a function `(ModelConfig, Runtime) -> Scorer`) and, for model-backed scorers, its
"module:standin" (a function `(Path) -> dict` that writes a small random model of the right family
into a folder and returns the config entry, relative to that folder's parent, that loads it).
Modules are imported on first use so that a stack without, say, the judge never imports its code.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rewardstack.models import resolve, spec

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig
    from rewardstack.scorers.base import Runtime, Scorer


def build_scorer(cfg: "ModelConfig", runtime: "Runtime") -> "Scorer":
    """Build the scorer for one configured model."""
    return resolve(spec(cfg.name).builder)(cfg, runtime)


def standin_builder(name: str) -> Callable[[Path], dict[str, Any]] | None:
    """The stand-in maker of a model-backed scorer (None for rule masks)."""
    ref = spec(name).standin
    return resolve(ref) if ref else None
