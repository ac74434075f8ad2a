"""The OOM guard: runs planned batches, and on out-of-memory frees, splits and retries, then falls back.

The except block only records the error: the retry happens after leaving it, because a live
exception's traceback pins the frames that hold the failed pass's tensors. A batch that runs out of
memory is split in half until single inputs remain; a single input that still does not fit is run
by the fallback (the model's weights lent to the host for that input) if there is one, else it gets
an explicit `oom` status. A batch that raises anything else is split the same way until the input
that fails is found, which gets the `error` status. Nothing is dropped.

Where the passes run: on the device (inside the simulated device's tracker on CPU), or in host
memory for a model that placement put on the CPU (`where_run`: outside every dispatch mode, so
invisible to the simulated device, with no device budget and no fallback).

`injector` (the soak's `FaultInjector`, tests/soak/faults.py) is any object whose
`during(model, batch)` context raises an `InjectedOOM` inside a pass: the guard records an injected
OOM like a real one (`OomRecord.injected` says which it was; the manager lowers the cost model's
trust for a real one only).
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rewardstack._memory.device import TensorBytesTracker

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._memory.placement import Placement

log = logging.getLogger("rewardstack.memory")

Forward = Callable[[list[int]], Sequence[Any]]
"""A scorer's pass: one value per input index it is given, in that order."""


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
    """An OOM raised on purpose inside a pass (the soak's fault injector, tests)."""


def free_device_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks (only called after an OOM, never per step)."""
    gc.collect()
    if device.type == "cuda":  # CUDA-only path
        torch.cuda.empty_cache()


def where_run(on_host: bool, tracker: TensorBytesTracker | None) -> AbstractContextManager[Any]:
    """Where a model's passes run: host memory, the simulated device, or the real one."""
    if on_host:  # outside every dispatch mode: invisible to the simulated device
        return _disable_current_modes()
    return tracker if tracker is not None else nullcontext()


def _attempt(model: str, batch: list[int], forward: Forward, injector: Any
             ) -> tuple[Sequence[Any] | None, str | None, bool, str | None]:
    """(values, OOM message, injected, other error) of one pass. Returning leaves the except block,
    so the failed pass's frames and tensors are freed before the caller frees memory and retries."""
    try:
        # The injected OOM strikes inside the pass, after its first allocations, so the path that
        # frees a failed pass's tensors runs as after a real OOM.
        with injector.during(model, batch) if injector is not None else nullcontext():
            return forward(batch), None, False, None
    except torch.OutOfMemoryError as e:
        return None, str(e).splitlines()[0] if str(e) else "out of memory", isinstance(e, InjectedOOM), None
    except Exception as e:  # noqa: BLE001 - one bad input must not take the loop down
        return None, None, False, f"{type(e).__name__}: {e}"


def run_guarded(
    model: str,
    batches: list[list[int]],
    lengths: Sequence[int],
    forward: Forward,
    *,
    device: torch.device,
    fallback: Forward | None,
    on_oom: Callable[[OomRecord], None],
    injector: Any = None,
    on_ok: Callable[[list[int]], None] | None = None,
) -> dict[int, Outcome]:
    """Run every batch; return one Outcome per input index. Never raises for OOM or model errors.

    `on_ok(batch)` is called for each batch that ran without an OOM (trust recovery counts them).
    """
    results: dict[int, Outcome] = {}
    stack = list(reversed(batches))
    while stack:
        batch = stack.pop()
        values, oom, injected, error = _attempt(model, batch, forward, injector)
        if values is not None:
            if len(values) != len(batch):
                raise RuntimeError(f"{model}: forward returned {len(values)} values for {len(batch)} inputs")
            results.update((i, Outcome(value=v)) for i, v in zip(batch, values))
            if on_ok is not None:
                on_ok(batch)
            continue
        if len(batch) > 1:  # isolate the input that fails, or halve what did not fit
            half = len(batch) // 2
            stack.extend([batch[half:], batch[:half]])
        if error is not None:
            if len(batch) == 1:
                log.error("%s: input %d failed: %s", model, batch[0], error)
                results[batch[0]] = Outcome(status="error", error=error)
            continue
        free_device_memory(device)
        action = "split" if len(batch) > 1 else "cpu_fallback" if fallback is not None else "gave_up"
        on_oom(OomRecord(model=model, batch=len(batch), length=max(lengths[i] for i in batch),
                         lengths=[int(lengths[i]) for i in batch], message=oom or "", action=action,
                         injected=injected, indices=list(batch)))
        if action == "cpu_fallback" and fallback is not None:
            try:
                (v,) = fallback(batch)
                results[batch[0]] = Outcome(value=v)
            except Exception as e:  # noqa: BLE001
                results[batch[0]] = Outcome(status="oom", error=f"cpu fallback failed: {e}")
        elif action == "gave_up":
            results[batch[0]] = Outcome(status="oom", error=oom)
    return results


def prepare_batches(name: str, prepare: Callable[[], Any], *, device: torch.device, on_host: bool,
                    tracker: TensorBytesTracker | None) -> None:
    """Run `prepare` where the batches will run; an OOM here is left to the guarded batches."""
    with torch.inference_mode():
        try:
            with where_run(on_host, tracker):
                prepare()
            return
        except torch.OutOfMemoryError as e:
            log.warning("%s: out of memory preparing the batches (%s); each batch retries it", name, e)
    free_device_memory(device)  # after the OOM, outside the except block: the traceback no longer pins the tensors


def cpu_fallback(owner: str, forward: Forward, placement: "Placement | None") -> Forward:
    """A fallback that runs `forward` with `owner`'s weights on the host, then moves them back."""

    def fallback(idx: list[int]) -> Sequence[Any]:
        started = time.perf_counter()
        lent = placement.lent_to_host(owner) if placement is not None and owner in placement.names() else nullcontext(0)
        with lent as moved, _disable_current_modes():  # host memory, as `where_run(on_host=True)`
            out = forward(idx)
        log.warning("CPU fallback: %s scored input %s on the host (%d bytes of weights moved, %.3fs)",
                    owner, idx, moved, time.perf_counter() - started)
        return out

    return fallback
