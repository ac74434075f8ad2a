"""A `FaultInjector` for tests: injection limited to some models, and counts of what it saw and did."""

from __future__ import annotations

from typing import Sequence

from tests.soak.faults import FaultInjector


class CountingInjector(FaultInjector):
    """Injects only into `models` (None: all); `calls` counts their passes, `injected` the OOMs raised."""

    def __init__(self, rate: float, seed: int = 0, *, models: Sequence[str] | None = None) -> None:
        super().__init__(rate, seed)
        self.models = set(models) if models is not None else None
        self.calls = self.injected = 0

    def draw(self, model: str) -> bool:
        if self.models is not None and model not in self.models:
            return False
        self.calls += 1
        hit = super().draw(model)
        self.injected += hit
        return hit
