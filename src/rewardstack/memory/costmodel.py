"""Predicts the peak activation bytes of one forward pass from its padded shape.

bytes(B, L) = a + b*B*L + c*B*L^2. `b` carries the per-token tensors (hidden states, logit chunks),
`c` carries attention scores that grow with the square of the length. The coefficients are fitted by
least squares to peaks measured in a short profile run; `trust` (<= 1) shrinks the budget a model may
plan against after its predictions were proved wrong by an OOM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class CostModel:
    """Peak activation bytes as a function of (batch, padded length)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    trust: float = 1.0
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (B, L, measured bytes)

    def predict(self, batch: int, length: int) -> float:
        """Predicted peak bytes of one forward pass over a (batch, length) padded rectangle."""
        if batch <= 0 or length <= 0:
            return 0.0
        bl = batch * length
        return self.a + self.b * bl + self.c * bl * length

    def fit(self, samples: Sequence[tuple[int, int, int]]) -> "CostModel":
        """Least-squares fit of a, b, c (all kept >= 0) to measured (B, L, bytes) samples."""
        if not samples:
            raise ValueError("cannot fit a cost model to no samples")
        x = np.array([[1.0, b * l, b * l * l] for b, l, _ in samples], dtype=np.float64)
        y = np.array([m for _, _, m in samples], dtype=np.float64)
        coef = _nonneg_lstsq(x, y)
        self.a, self.b, self.c = (float(v) for v in coef)
        self.samples = [tuple(int(v) for v in s) for s in samples]  # type: ignore[misc]
        return self

    def max_error(self) -> float:
        """The largest relative error of the fit over the samples it saw."""
        errs = [abs(self.predict(b, l) - m) / max(m, 1) for b, l, m in self.samples]
        return max(errs) if errs else 0.0

    def distrust(self, factor: float = 0.8, floor: float = 0.25) -> None:
        """Lower trust after an OOM: later plans use a smaller share of the budget."""
        self.trust = max(floor, self.trust * factor)

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"bytes = {self.a:.3g} + {self.b:.3g}*B*L + {self.c:.3g}*B*L^2 "
            f"(trust {self.trust:.2f}, {len(self.samples)} shapes, max fit error {self.max_error():.1%})"
        )

    def to_dict(self) -> dict:
        """JSON-able form (for logs and telemetry)."""
        return {"a": self.a, "b": self.b, "c": self.c, "trust": self.trust, "samples": self.samples}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients clamped to >= 0 by dropping negative ones and refitting."""
    active = list(range(x.shape[1]))
    while True:
        # Relative weighting: each sample's error counts relative to its size, so small shapes
        # are fitted as well as big ones.
        w = 1.0 / np.maximum(y, 1.0)
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef = np.zeros(x.shape[1])
            coef[active] = np.maximum(sol, 0)
            return coef
        active = [a for a, s in zip(active, sol) if s >= 0] or [active[int(np.argmax(sol))]]


def profile_shapes(max_length: int, max_batch: int = 8) -> list[tuple[int, int]]:
    """A small grid of (batch, length) shapes for a profile run, up to `max_length`."""
    lengths = sorted({max(8, max_length // 8), max(16, max_length // 4), max(32, max_length // 2), max_length})
    batches = sorted({1, max(1, max_batch // 2), max_batch})
    return [(b, l) for l in lengths for b in batches if l <= max_length]


def profile(
    run: Callable[[int, int], None],
    measure: Callable[[Callable[[], None]], int],
    shapes: Sequence[tuple[int, int]],
) -> CostModel:
    """Measure `run(B, L)` at each shape with `measure` (returns peak bytes) and fit a cost model."""
    samples = [(b, l, measure(lambda b=b, l=l: run(b, l))) for b, l in shapes]
    return CostModel().fit(samples)
