"""Injected out-of-memory errors for the soak: OOMs raised inside real forward passes.

The soak's faulted run (`tests.soak.supervisor`) sets a `FaultInjector` as the memory
manager's `injector`; the OOM guard (`rewardstack._memory.guard`) runs each device pass inside its
`during`, so the injected OOM strikes after the pass's first allocations and the path that frees a
failed pass's tensors runs as after a real OOM.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator, Sequence

from torch.utils._python_dispatch import TorchDispatchMode

from rewardstack._memory.device import tensors_in
from rewardstack._memory.guard import InjectedOOM


class FaultInjector:
    """Fails a device forward pass with an injected OOM with probability `rate`.

    `during` raises the OOM inside the pass after its first allocations. Deterministic: the same
    seed and the same sequence of calls inject at the same passes (`draw` decides each).
    """

    MAX_AFTER = 8
    """`during` fails a pass after 1..MAX_AFTER tensor-creating ops."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate = rate
        self.rng = random.Random(seed)

    def draw(self, model: str) -> bool:
        """Whether the next pass of `model` gets an OOM (every model alike here)."""
        return self.rate > 0 and self.rng.random() < self.rate

    @contextmanager
    def during(self, model: str, batch: Sequence[int]) -> Iterator[None]:
        """Run one forward pass that, with probability `rate`, fails with an `InjectedOOM` inside it.

        The OOM is raised after the pass's first 1..`MAX_AFTER` tensor-creating ops (drawn from the
        seed), so the tensors it already allocated are live when it fails, as in a real OOM; a pass
        with fewer ops fails at its end. Other passes run untouched.
        """
        if not self.draw(model):
            yield
            return
        message = f"injected OOM in {model} (batch of {len(batch)})"
        with _RaiseAfter(self.rng.randint(1, self.MAX_AFTER), message):
            yield
        raise InjectedOOM(message)


class _RaiseAfter(TorchDispatchMode):
    """Raises an injected OOM once `after` aten ops have returned tensors (allocations made)."""

    def __init__(self, after: int, message: str) -> None:
        super().__init__()
        self.left, self.message = after, message

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.left > 0 and tensors_in(out):
            self.left -= 1
            if self.left == 0:  # fires once
                raise InjectedOOM(self.message)
        return out
