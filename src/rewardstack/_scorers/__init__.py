"""The scorers: one module per family, each with its builders; they only score.

The model registry (`rewardstack._models`) names, per event name of the spec, its "module:builder"
(a function `(ModelConfig, Runtime) -> Scorer`); the stand-in checkpoints the tests and
`make-standins` load are written by `rewardstack._standins`, a layer above this one.
Modules are imported on first use so that a stack without, say, the judge never imports its code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rewardstack._models import resolve, spec

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig
    from rewardstack._scorers.base import Runtime, Scorer


def build_scorer(cfg: "ModelConfig", runtime: "Runtime") -> "Scorer":
    """Build the scorer for one configured model."""
    return resolve(spec(cfg.name).builder)(cfg, runtime)

