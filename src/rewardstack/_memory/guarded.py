"""Where a guarded run's passes run: the planned batches under the OOM guard, on the device (under
the simulated device's tracker on CPU) or in host memory, the shared prefix before them, and the
CPU fallback that lends a model's weights to the host for one input.

Plain functions; `MemoryManager.run` plans the batches and composes them with its own state (the
placement, the tracker, the fault injector, the OOM log) passed in.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rewardstack._memory.costmodel import CostModel
from rewardstack._memory.guard import FaultInjector, OomRecord, Outcome, free_device_memory, run_guarded
from rewardstack._memory.placement import Placement
from rewardstack._memory.tracker import TensorBytesTracker

log = logging.getLogger("rewardstack.memory")

Forward = Callable[[list[int]], Sequence[Any]]


def run_batches(
    name: str,
    batches: list[list[int]],
    lengths: Sequence[int],
    forward: Forward,
    *,
    cost: CostModel,
    device: torch.device,
    on_host: bool,
    tracker: TensorBytesTracker | None,
    injector: FaultInjector | None,
    fallback: Forward | None,
    on_oom: Callable[[OomRecord], None],
) -> dict[int, Outcome]:
    """Run `batches` under the OOM guard (split, retry, `fallback`, explicit `oom` status); one
    outcome per input index.

    `on_host`: the model was placed on the CPU, so its batches run in host memory, with no device
    budget, no injected device OOMs and no fallback. Every OOM goes to `on_oom`; a real one also
    lowers `cost`'s trust, which clean batches bring back.
    """

    def oom(rec: OomRecord) -> None:
        on_oom(rec)
        if not rec.injected:
            cost.distrust()
        log.warning(
            "OOM in %s: batch %d x %d (lengths %s) -> %s: %s",
            rec.model, rec.batch, rec.length, rec.lengths[:8], rec.action, rec.message,
        )

    def ok(batch: list[int]) -> None:
        cost.record_clean()  # trust lowered by OOMs grows back after a run of clean batches

    with torch.inference_mode():
        if on_host:
            with host_memory():
                return run_guarded(name, batches, lengths, forward, device=torch.device("cpu"),
                                   fallback=None, on_oom=oom, injector=None)
        if tracker is not None:
            with tracker:
                return run_guarded(name, batches, lengths, forward, device=device,
                                   fallback=fallback, on_oom=oom, injector=injector, on_ok=ok)
        return run_guarded(name, batches, lengths, forward, device=device,
                           fallback=fallback, on_oom=oom, injector=injector, on_ok=ok)


def prepare_batches(
    name: str, prepare: Callable[[], Any], *, device: torch.device, on_host: bool, tracker: TensorBytesTracker | None
) -> None:
    """Run `prepare` where the batches will run; an OOM here is left to the guarded batches."""
    failed = False
    with torch.inference_mode():
        try:
            if on_host:
                with host_memory():
                    prepare()
            elif tracker is not None:
                with tracker:
                    prepare()
            else:
                prepare()
        except torch.OutOfMemoryError as e:
            log.warning("%s: out of memory preparing the batches (%s); each batch retries it", name, e)
            failed = True
    if failed:  # outside the except block: the traceback no longer pins the tensors
        free_device_memory(device)


def cpu_fallback(owner: str, forward: Forward, placement: Placement | None, counted: Callable[[], None]) -> Forward:
    """A fallback that runs `forward` with `owner`'s weights on the host, then moves them back;
    `counted()` is called once per input so scored."""

    def fallback(idx: list[int]) -> Sequence[Any]:
        started = time.perf_counter()
        moved = 0
        if placement is not None and owner in placement.names():
            with placement.lent_to_host(owner) as moved, host_memory():
                out = forward(idx)
        else:
            with host_memory():
                out = forward(idx)
        counted()
        log.warning("CPU fallback: %s scored input %s on the host (%d bytes of weights moved, %.3fs)",
                    owner, idx, moved, time.perf_counter() - started)
        return out

    return fallback


@contextmanager
def host_memory() -> Iterator[None]:
    """Run outside every dispatch mode: host memory, invisible to the simulated device."""
    with _disable_current_modes():
        yield
