"""The memory manager: the one object scorers ask to run their forward passes.

It owns the budget, the tracker (simulated device on CPU), the per-model cost models and the OOM log.
`run` plans batches from token lengths, runs them under the OOM guard and returns outcomes in input
order. `length_cap` tells a scorer how long one input may be and still fit alone.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack.memory.costmodel import CostModel, profile, profile_shapes
from rewardstack.memory.guard import FaultInjector, OomRecord, Outcome, run_guarded
from rewardstack.memory.planner import max_fitting_length, plan_batches
from rewardstack.memory.tracker import TensorBytesTracker

log = logging.getLogger("rewardstack.memory")


class MemoryManager:
    """Plans and guards every forward pass against one activation budget.

    `budget_bytes` is the activation budget (weights excluded); None means unlimited. On CPU a
    `TensorBytesTracker` enforces it as a simulated device; on CUDA the real allocator does.
    """

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        device: torch.device | str = "cpu",
        margin: float = 0.9,
        injector: FaultInjector | None = None,
        simulate: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.margin = margin
        self.injector = injector
        self.cost_models: dict[str, CostModel] = {}
        self.oom_log: list[OomRecord] = []
        if simulate is None:
            simulate = self.device.type != "cuda"
        self.tracker: TensorBytesTracker | None = TensorBytesTracker(budget_bytes) if simulate else None

    # -- cost models ------------------------------------------------------------------------
    def cost_model(self, name: str) -> CostModel:
        """The cost model registered for a scorer (an empty one, predicting 0, if none yet)."""
        return self.cost_models.setdefault(name, CostModel())

    def set_cost_model(self, name: str, cost: CostModel) -> None:
        """Register a fitted cost model and log it."""
        self.cost_models[name] = cost
        log.info("cost model for %s: %s", name, cost.describe())

    def length_cap(self, name: str, upper: int) -> int:
        """The longest input (alone) that the budget is predicted to hold, at most `upper`."""
        if self.budget_bytes is None:
            return upper
        return max(1, max_fitting_length(self.cost_model(name), self.budget_bytes, self.margin, upper))

    def calibrate(
        self,
        name: str,
        run: Callable[[int, int], Any],
        *,
        max_length: int,
        max_batch: int = 8,
        shapes: Sequence[tuple[int, int]] | None = None,
    ) -> CostModel:
        """Profile `run(B, L)` (one forward pass on a B x L dummy batch) and fit the cost model."""
        grid = list(shapes) if shapes is not None else profile_shapes(max_length, max_batch)
        with torch.inference_mode():
            cost = profile(run, lambda fn: self.measure(fn, f"profile:{name}"), grid)
        self.set_cost_model(name, cost)
        return cost

    # -- measuring --------------------------------------------------------------------------
    def measure(self, fn: Callable[[], Any], name: str = "measure") -> int:
        """Peak activation bytes of running `fn` (tracker on CPU, allocator stats on CUDA)."""
        if self.tracker is not None:
            with self.tracker.window(name) as w, _no_budget(self.tracker):
                fn()
            return w.peak_increase
        return _cuda_peak(fn, self.device)  # CUDA-only path

    @contextmanager
    def active(self) -> Iterator[None]:
        """Track (and on CPU, enforce the budget of) everything run inside."""
        if self.tracker is None:
            yield
            return
        with self.tracker.window("run"):
            yield

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Callable[[list[int]], Sequence[Any]],
        *,
        max_batch: int | None = None,
        fallback: Callable[[list[int]], Sequence[Any]] | None = None,
    ) -> list[Outcome]:
        """Plan batches for `lengths`, run `forward(indices)` on each under the guard.

        `forward` returns one value per index it was given. `fallback` (same signature, one index)
        scores an input off-device when even a batch of one runs out of memory; on a CPU device
        with a simulated budget the default fallback is `forward` run in host memory (no budget).
        """
        if not lengths:
            return []
        cost = self.cost_model(name)
        budget = float("inf") if self.budget_bytes is None else self.budget_bytes
        batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch)
        if fallback is None and self.tracker is not None:
            tracker = self.tracker

            def fallback(idx: list[int]) -> Sequence[Any]:
                with _no_budget(tracker):
                    return forward(idx)

        def on_oom(rec: OomRecord) -> None:
            self.oom_log.append(rec)
            if not rec.injected:
                cost.distrust()
            log.warning(
                "OOM in %s: batch %d x %d (lengths %s) -> %s: %s",
                rec.model, rec.batch, rec.length, rec.lengths[:8], rec.action, rec.message,
            )

        with torch.inference_mode(), (self.tracker if self.tracker is not None else nullcontext()):
            results = run_guarded(
                name, batches, lengths, forward,
                device=self.device, fallback=fallback, on_oom=on_oom, injector=self.injector,
            )
        return [results[i] for i in range(len(lengths))]


@contextmanager
def _no_budget(tracker: TensorBytesTracker) -> Iterator[None]:
    """Lift the tracker's budget inside (host memory, profile runs); keep counting."""
    saved = tracker.budget_bytes
    tracker.budget_bytes = None
    try:
        yield
    finally:
        tracker.budget_bytes = saved


def _cuda_peak(fn: Callable[[], Any], device: torch.device) -> int:  # CUDA-only path
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - start)
