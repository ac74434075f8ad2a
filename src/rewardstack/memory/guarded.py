"""The guarded run: the memory manager plans a model's batches and runs them under the OOM guard.

A mixin of `MemoryManager` (`rewardstack.memory.manager`): `run` tells the observers, makes sure
the model is where it runs, plans batches against the budget minus what is live, runs them under
the guard (split, retry, CPU fallback, explicit `oom` status) and returns outcomes in input order.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rewardstack.memory.guard import OomRecord, Outcome, free_device_memory, run_guarded
from rewardstack.memory.planner import plan_batches
from rewardstack.models import owner_of

log = logging.getLogger("rewardstack.memory")


class GuardedRun:
    """`MemoryManager.run` and its CPU fallback (state lives on the manager)."""

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Callable[[list[int]], Sequence[Any]],
        *,
        max_batch: int | None = None,
        fallback: Callable[[list[int]], Sequence[Any]] | None = None,
        prepare: Callable[[], Any] | None = None,
        slack: float | None = None,
        prefix: int = 0,
        completions: Sequence[int | None] | None = None,
    ) -> list[Outcome]:
        """Plan batches for `lengths`, run `forward(indices)` on each under the guard.

        `forward` returns one value per index it was given, with inputs moved to the model's
        current device. `prepare()` runs first, on the device, and what it keeps (a shared
        prefix's keys and values) is live when the batches are planned, so it is not counted as
        free. `fallback` (same signature, one index) scores an input off-device when even a batch
        of one runs out of memory. Without one, a model allowed on the CPU (`cpu_ok`: the filters)
        gets a real CPU fallback: its weights move to the host for that input and back, and the
        cost (bytes moved, seconds) is logged; any other model's input gets the `oom` status. A
        model that placement put on the CPU runs in host memory, outside the device budget.
        `slack`: batches also close where their padding would pass that share (`plan_batches`): a
        scorer that runs each batch in `padding_groups` passes `PADDING_SLACK`, so the rectangle
        planned and predicted is the one that runs. `prefix`: that many tokens of every input
        are a shared prefix `prepare` runs once (`CostModel.predict(prefix=)`). `completions`:
        the step's completion index of each input (None: the prompt), for the observers' records,
        which would otherwise know only the scorer's own numbering (DPO skips empty completions,
        the classifiers merge identical texts and cut long ones into windows).
        """
        if completions is not None and len(completions) != len(lengths):
            raise ValueError(f"{name}: {len(completions)} completion indices for {len(lengths)} inputs")
        with ExitStack() as observed:
            for o in list(self.observers):  # e.g. replay's per-model peak window
                observed.enter_context(o.run(name, lengths))
            return self._run(name, lengths, forward, max_batch=max_batch, fallback=fallback, prepare=prepare, slack=slack,
                             prefix=prefix, completions=completions)

    def _run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Callable[[list[int]], Sequence[Any]],
        *,
        max_batch: int | None,
        fallback: Callable[[list[int]], Sequence[Any]] | None,
        prepare: Callable[[], Any] | None,
        slack: float | None = None,
        prefix: int = 0,
        completions: Sequence[int | None] | None = None,
    ) -> list[Outcome]:
        if not lengths:
            return []
        on_host = False
        # A run named `model[k]` (one of a scorer's several models) is placed with its scorer.
        owner = owner_of(name)
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)
            on_host = self.device_for(owner) != self.device or self.placement.decisions[owner].where == "cpu"
            if self.up_next is not None and self.up_next != owner and self.up_next in self.placement.names():
                # After this model is on the card, so the copy cannot evict it: on CUDA with pinned
                # host copies the next model's weights move on the side stream while this one
                # computes; elsewhere `prefetch` declines and `ensure` moves it when it runs.
                self.placement.prefetch(self.up_next)
        cost = self.cost_model(name)
        if prepare is not None:
            self._prepare(name, prepare, on_host)
        budget = float("inf") if (self.budget_bytes is None or on_host) else float(self.budget_bytes)
        if budget != float("inf"):
            # Bytes already live on the device (kept outputs, prefix caches) are not free.
            budget = max(0.0, budget - self.live_bytes())
        batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch, largest_first=True,
                               slack=slack, prefix=prefix)
        for o in list(self.observers):  # e.g. one telemetry record per batch the guard runs (the fallback's too)
            forward = o.batch(name, lengths, forward, cost, on_host, prefix=prefix, completions=completions)
        if fallback is None and not on_host and self._cpu_ok(owner):
            fallback = self._cpu_fallback(owner, forward)

        def on_oom(rec: OomRecord) -> None:
            self.oom_log.append(rec)
            self.ooms_total += 1
            self.ooms_injected += int(rec.injected)
            for o in list(self.observers):
                o.oom(rec)
            if not rec.injected:
                cost.distrust()
            log.warning(
                "OOM in %s: batch %d x %d (lengths %s) -> %s: %s",
                rec.model, rec.batch, rec.length, rec.lengths[:8], rec.action, rec.message,
            )

        def on_ok(batch: list[int]) -> None:
            cost.record_clean()  # trust lowered by OOMs grows back after a run of clean batches

        with torch.inference_mode():
            if on_host:
                # Placed on CPU: host memory, no device budget, no injected device OOMs.
                with _host_memory():
                    results = run_guarded(name, batches, lengths, forward, device=torch.device("cpu"),
                                          fallback=None, on_oom=on_oom, injector=None)
            elif self.tracker is not None:
                with self.tracker:
                    results = run_guarded(name, batches, lengths, forward, device=self.device,
                                          fallback=fallback, on_oom=on_oom, injector=self.injector, on_ok=on_ok)
            else:
                results = run_guarded(name, batches, lengths, forward, device=self.device,
                                      fallback=fallback, on_oom=on_oom, injector=self.injector, on_ok=on_ok)
        return [results[i] for i in range(len(lengths))]

    def _prepare(self, name: str, prepare: Callable[[], Any], on_host: bool) -> None:
        """Run `prepare` where the batches will run; an OOM here is left to the guarded batches."""
        failed = False
        with torch.inference_mode():
            try:
                if on_host:
                    with _host_memory():
                        prepare()
                elif self.tracker is not None:
                    with self.tracker:
                        prepare()
                else:
                    prepare()
            except torch.OutOfMemoryError as e:
                log.warning("%s: out of memory preparing the batches (%s); each batch retries it", name, e)
                failed = True
        if failed:  # outside the except block: the traceback no longer pins the tensors
            free_device_memory(self.device)

    def _cpu_ok(self, owner: str) -> bool:
        reg = self._registered.get(owner)
        return bool(reg and reg[2])

    def _cpu_fallback(self, owner: str, forward: Callable[[list[int]], Sequence[Any]]) -> Callable[[list[int]], Sequence[Any]]:
        """A fallback that runs `forward` with the model's weights on the host, then moves them back."""

        def fallback(idx: list[int]) -> Sequence[Any]:
            started = time.perf_counter()
            moved = 0
            if self.placement is not None and owner in self.placement.names():
                with self.placement.lent_to_host(owner) as moved, _host_memory():
                    out = forward(idx)
            else:
                with _host_memory():
                    out = forward(idx)
            self.fallbacks_total += 1
            log.warning("CPU fallback: %s scored input %s on the host (%d bytes of weights moved, %.3fs)",
                        owner, idx, moved, time.perf_counter() - started)
            return out

        return fallback


@contextmanager
def _host_memory() -> Iterator[None]:
    """Run outside every dispatch mode: host memory, invisible to the simulated device."""
    with _disable_current_modes():
        yield
