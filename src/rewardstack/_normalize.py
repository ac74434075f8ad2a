"""The running normalizer of reward models (openvalidators' `normalize_rewards`, defects fixed).

Per step, the valid raw rewards update a running count/mean/variance (capped count, so old history
fades), then each reward becomes `0.5 * (1 + erf(z / sqrt(2)))` with `z = (r - mean) / sqrt(var)`.
Fixed against the reference: a single sample has variance 0 (the reference's NaN would stick in the
statistics forever), and NaN raw rewards never enter the statistics (they normalize to 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass
class RunningNormalizer:
    """count / mean / var of everything seen so far, with `count` capped at `count_limit`."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0
    count_limit: int = 3000

    def update(self, raw: Sequence[float]) -> None:
        """Fold the finite values of `raw` into the statistics."""
        r = [float(x) for x in raw if math.isfinite(x)]
        n = len(r)
        if n == 0:
            return
        m = sum(r) / n
        v = sum((x - m) ** 2 for x in r) / (n - 1) if n > 1 else 0.0
        w_new = n / (self.count + n)
        w_old = self.count / (self.count + n)
        d = m - self.mean
        self.mean = w_new * m + w_old * self.mean
        self.var = w_new * v + w_old * self.var + w_new * w_old * d * d
        self.count = min(self.count_limit, self.count + n)

    def transform(self, raw: Sequence[float]) -> list[float]:
        """Map raw rewards through the current statistics; non-finite raw values map to 0."""
        sd = math.sqrt(self.var) if self.var > 0 else None
        out = []
        for x in raw:
            if not math.isfinite(x):
                out.append(0.0)
                continue
            z = (x - self.mean) / sd if sd is not None else (x - self.mean)
            out.append(0.5 * (1.0 + math.erf(z / math.sqrt(2.0))))
        return out

    def __call__(self, raw: Sequence[float]) -> list[float]:
        """Update with `raw`, then transform it (the reference's order)."""
        self.update(raw)
        return self.transform(raw)

    def to_dict(self) -> dict:
        """JSON-able state."""
        return {"count": self.count, "mean": self.mean, "var": self.var, "count_limit": self.count_limit}

    @classmethod
    def from_dict(cls, d: dict) -> "RunningNormalizer":
        """Restore from `to_dict` output; rejects non-finite statistics."""
        n = cls(int(d["count"]), float(d["mean"]), float(d["var"]), int(d.get("count_limit", 3000)))
        if not (math.isfinite(n.mean) and math.isfinite(n.var)) or n.var < 0 or n.count < 0:
            raise ValueError(f"invalid normalizer state {d!r}")
        return n
