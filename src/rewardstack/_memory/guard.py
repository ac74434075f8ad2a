"""The OOM guard: runs a batch, and on out-of-memory frees, splits and retries, then falls back.

The except block only records the error: the retry happens after leaving it, because a live
exception's traceback pins the frames that hold the failed pass's tensors. A batch that runs out of
memory is split in half until single inputs remain; a single input that still does not fit is run
by the fallback (CPU) if there is one, else it gets an explicit OOM status. Nothing is dropped.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rewardstack._memory.tracker import tensors_in

log = logging.getLogger("rewardstack.memory")


@dataclass
class Outcome:
    """The result for one input: a value, or None with the status that says why."""

    value: Any = None
    status: str = "ok"
    error: str | None = None


@dataclass
class OomRecord:
    """One out-of-memory event: which model, which batch shape and lengths, what happened next."""

    model: str
    batch: int
    length: int
    lengths: list[int]
    message: str
    action: str  # "split", "cpu_fallback" or "gave_up"
    injected: bool = False
    time: float = field(default_factory=time.time)
    indices: list[int] = field(default_factory=list)  # the batch's input indices (incident records)

    def to_dict(self) -> dict:
        """JSON-able form."""
        return dict(self.__dict__)


class InjectedOOM(torch.OutOfMemoryError):
    """An OOM raised on purpose by a `FaultInjector` (tests, soak runs)."""


class FaultInjector:
    """Fails a device forward pass with an injected OOM with probability `rate`.

    `run_guarded` runs each pass inside `during`, which raises the OOM inside the pass after its
    first allocations; `maybe_raise` raises before a pass (for callers without a pass to enter).

    Deterministic: the same seed and the same sequence of calls inject at the same passes.
    `models` limits injection to those model names (None: all). `calls` and `injected` count
    passes seen and OOMs raised, per model in `by_model`.
    """

    def __init__(self, rate: float, seed: int = 0, *, models: Sequence[str] | None = None) -> None:
        self.rate = rate
        self.seed = seed
        self.models = set(models) if models is not None else None
        self.rng = random.Random(seed)
        self.calls = 0
        self.injected = 0
        self.by_model: dict[str, list[int]] = {}  # name -> [calls, injected]
        self.max_after = 8  # `during` fails a pass after 1..max_after tensor-creating ops

    def reset(self) -> None:
        """Start the same sequence of injections again."""
        self.rng = random.Random(self.seed)
        self.calls = self.injected = 0
        self.by_model.clear()

    def _draw(self, model: str) -> bool:
        """Count a pass and decide whether it gets an OOM."""
        if self.models is not None and model not in self.models:
            return False
        self.calls += 1
        counts = self.by_model.setdefault(model, [0, 0])
        counts[0] += 1
        if self.rate > 0 and self.rng.random() < self.rate:
            self.injected += 1
            counts[1] += 1
            return True
        return False

    @contextmanager
    def during(self, model: str, batch: Sequence[int]) -> Iterator[None]:
        """Run one forward pass that, with probability `rate`, fails with an `InjectedOOM` inside it.

        The OOM is raised after the pass's first 1..`max_after` tensor-creating ops (drawn from the
        seed), so the tensors it already allocated are live when it fails, as in a real OOM; a pass
        with fewer ops fails at its end. Other passes run untouched.
        """
        if not self._draw(model):
            yield
            return
        message = f"injected OOM in {model} (batch of {len(batch)})"
        mode = _RaiseAfter(self.rng.randint(1, self.max_after), message)
        with mode:
            yield
        raise InjectedOOM(message)

    def maybe_raise(self, model: str, batch: Sequence[int]) -> None:
        """Raise an `InjectedOOM` with probability `rate`."""
        if self._draw(model):
            raise InjectedOOM(f"injected OOM in {model} (batch of {len(batch)})")


class _RaiseAfter(TorchDispatchMode):
    """Raises an injected OOM once `after` aten ops have returned tensors (allocations made)."""

    def __init__(self, after: int, message: str) -> None:
        super().__init__()
        self.after = after
        self.message = message
        self.seen = 0
        self.fired = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if not self.fired and tensors_in(out):
            self.seen += 1
            if self.seen >= self.after:
                self.fired = True
                raise InjectedOOM(self.message)
        return out


def free_device_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks (only called after an OOM, never per step)."""
    gc.collect()
    if device.type == "cuda":  # CUDA-only path
        torch.cuda.empty_cache()


def run_guarded(
    model: str,
    batches: list[list[int]],
    lengths: Sequence[int],
    forward: Callable[[list[int]], Sequence[Any]],
    *,
    device: torch.device,
    fallback: Callable[[list[int]], Sequence[Any]] | None,
    on_oom: Callable[[OomRecord], None],
    injector: FaultInjector | None = None,
    on_ok: Callable[[list[int]], None] | None = None,
) -> dict[int, Outcome]:
    """Run every batch; return one Outcome per input index. Never raises for OOM or model errors.

    `on_ok(batch)` is called for each batch that ran without an OOM (trust recovery counts them).
    """
    results: dict[int, Outcome] = {}
    stack = list(reversed(batches))
    while stack:
        batch = stack.pop()
        oom_message: str | None = None
        injected = False
        other_error: str | None = None
        values: Sequence[Any] | None = None
        try:
            if injector is not None:
                # The injected OOM strikes inside the pass, after its first allocations, so the
                # path that frees a failed pass's tensors runs as after a real OOM.
                with injector.during(model, batch):
                    out = forward(batch)
                values = out
            else:
                values = forward(batch)
        except torch.OutOfMemoryError as e:
            oom_message = str(e).splitlines()[0] if str(e) else "out of memory"
            injected = isinstance(e, InjectedOOM)
        except Exception as e:  # noqa: BLE001 - one bad input must not take the loop down
            other_error = f"{type(e).__name__}: {e}"
        # Out of the except block: the traceback and its frames are gone now.
        if values is not None:
            if len(values) != len(batch):
                raise RuntimeError(f"{model}: forward returned {len(values)} values for {len(batch)} inputs")
            for i, v in zip(batch, values):
                results[i] = Outcome(value=v)
            if on_ok is not None:
                on_ok(batch)
            continue
        if other_error is not None:
            if len(batch) > 1:  # isolate the input that fails
                half = len(batch) // 2
                stack.extend([batch[half:], batch[:half]])
            else:
                log.error("%s: input %d failed: %s", model, batch[0], other_error)
                results[batch[0]] = Outcome(status="error", error=other_error)
            continue
        free_device_memory(device)
        shape_len = max(lengths[i] for i in batch)
        if len(batch) > 1:
            action = "split"
            half = len(batch) // 2
            stack.extend([batch[half:], batch[:half]])
        elif fallback is not None:
            action = "cpu_fallback"
        else:
            action = "gave_up"
        on_oom(
            OomRecord(
                model=model,
                batch=len(batch),
                length=shape_len,
                lengths=[int(lengths[i]) for i in batch],
                message=oom_message or "",
                action=action,
                injected=injected,
                indices=list(batch),
            )
        )
        if action == "cpu_fallback":
            assert fallback is not None
            try:
                (v,) = fallback(batch)
                results[batch[0]] = Outcome(value=v)
            except Exception as e:  # noqa: BLE001
                results[batch[0]] = Outcome(status="oom", error=f"cpu fallback failed: {e}")
        elif action == "gave_up":
            results[batch[0]] = Outcome(status="oom", error=oom_message)
    return results
