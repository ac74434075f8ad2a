"""The memory manager: the one object scorers ask to run their forward passes.

It owns the budget, the tracker (simulated device on CPU), the per-model cost models, the OOM log
and (when the stack's weights do not fit) the placement. `run` plans batches from token lengths,
makes sure the model is on its device, runs the batches under the OOM guard and returns outcomes in
input order. `length_cap` tells a scorer how long one input may be and still fit alone.

The stack's order of calls (see docs in `setup`):
  configure_allocator(); mm = MemoryManager(None, device=...); build scorers (they `calibrate`);
  mm.register_model(name, modules) per model; mm.setup(cfg) -> Budget; then score.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rewardstack.memory.budget import Budget, cuda_total_memory, compute_budget, weights_bytes
from rewardstack.memory.costmodel import CostModel, profile, profile_shapes
from rewardstack.memory.guard import FaultInjector, OomRecord, Outcome, run_guarded
from rewardstack.memory.placement import Decision, Placement
from rewardstack.memory.planner import max_fitting_length, plan_batches
from rewardstack.memory.tracker import TensorBytesTracker

log = logging.getLogger("rewardstack.memory")

# On CUDA, when the weights do not fit, the share of the usable memory kept for activations.
ACTIVATION_SHARE = 0.2


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
        self.placement: Placement | None = None
        self.budget: Budget | None = None
        # Telemetry (rewardstack.telemetry.monitor.Monitor): sees every batch the guard runs and
        # every OOM; None: nothing is recorded.
        self.observer: Any | None = None
        self._registered: dict[str, tuple[list[torch.nn.Module], float, bool]] = {}
        self._profile_runs: dict[str, Callable[[int, int], Any]] = {}
        if simulate is None:
            simulate = self.device.type != "cuda"
        self.tracker: TensorBytesTracker | None = TensorBytesTracker(budget_bytes) if simulate else None

    # -- budget and placement ---------------------------------------------------------------
    def set_budget(self, budget_bytes: int | None) -> None:
        """Change the activation budget (and the simulated device's limit)."""
        self.budget_bytes = budget_bytes
        if self.tracker is not None:
            self.tracker.budget_bytes = budget_bytes
        log.info("activation budget: %s", "unlimited" if budget_bytes is None else f"{budget_bytes} bytes")

    def register_model(
        self, name: str, modules: list[torch.nn.Module], *, priority: float = 1.0, cpu_ok: bool = False
    ) -> None:
        """Declare a model's modules (for weight accounting and placement). `cpu_ok`: may run on CPU."""
        self._registered[name] = (list(modules), priority, cpu_ok)
        if self.placement is not None:
            self.placement.register(name, list(modules), priority=priority, cpu_ok=cpu_ok)

    def place(self, weights_budget: int | None, *, move: bool | None = None) -> dict[str, Decision]:
        """Plan placement of the registered models under a weight budget (bytes on the device)."""
        self.placement = Placement(self.device, weights_budget, move=move)
        for name, (mods, prio, cpu_ok) in self._registered.items():
            self.placement.register(name, mods, priority=prio, cpu_ok=cpu_ok)
        return self.placement.plan()

    def setup(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> Budget:
        """Resolve the budget from a StackConfig and place the registered models.

        CUDA: usable = total x gpu_utilization - headroom. If the weights fit in usable minus an
        activation share, all are resident and activations get the rest (or `memory_budget`).
        Otherwise weights get (1 - ACTIVATION_SHARE) of usable, placed by `Placement`.
        CPU (simulated device): `memory_budget` is both the activation budget the tracker enforces
        and the size of the simulated device the weights are placed into; None: unlimited.
        """
        seen: dict[int, torch.nn.Module] = {}
        for mods, _, _ in self._registered.values():
            for m in mods:
                seen[id(m)] = m
        weights = weights_bytes(list(seen.values()))
        if self.device.type == "cuda" or total_memory is not None:
            # The card's size, whether or not memory_budget fixes the activation budget.
            total_bytes = (total_memory or cuda_total_memory)(self.device)
            usable = int(total_bytes * cfg.gpu_utilization) - cfg.headroom_bytes
            if weights <= usable * (1 - ACTIVATION_SHARE):
                weights_budget: int | None = None
                budget = compute_budget(cfg, self.device, weights, total_memory=total_memory)
            else:
                weights_budget = int(usable * (1 - ACTIVATION_SHARE))
                act = cfg.memory_budget if cfg.memory_budget is not None else usable - weights_budget
                budget = Budget(str(self.device), int(act), "device", total_bytes,
                                cfg.gpu_utilization, weights_budget, cfg.headroom_bytes)
        else:
            budget = compute_budget(cfg, self.device, weights)
            weights_budget = cfg.memory_budget
        self.budget = budget
        log.info("memory budget: %s (stack weights %d bytes)", budget.describe(), weights)
        self.set_budget(budget.activation_bytes)
        if self._registered:
            self.place(weights_budget)
        return budget

    def weights_capacity(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """Device bytes the weights may hold while models load (None: no real device limit).

        The share `setup` gives weights when they do not all fit: usable x (1 - ACTIVATION_SHARE).
        """
        if self.device.type != "cuda" and total_memory is None:
            return None
        total_bytes = (total_memory or cuda_total_memory)(self.device)
        usable = int(total_bytes * cfg.gpu_utilization) - cfg.headroom_bytes
        return max(0, int(usable * (1 - ACTIVATION_SHARE)))

    def device_for(self, name: str) -> torch.device:
        """The device `name`'s forward runs on now (the host if placement put it on CPU)."""
        if self.placement is None or name not in self.placement.names():
            return self.device
        return self.placement.where(name)

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
        budget = float(self.budget_bytes)
        if self.tracker is not None:
            budget = max(0.0, budget - self.tracker.live_bytes)  # as `run` plans: live bytes are not free
        return max(1, max_fitting_length(self.cost_model(name), budget, self.margin, upper))

    def calibrate(
        self,
        name: str,
        run: Callable[[int, int], Any],
        *,
        max_length: int,
        max_batch: int = 8,
        shapes: Sequence[tuple[int, int]] | None = None,
        chunk: int | None = None,
        chunk_rows: bool = False,
    ) -> CostModel:
        """Profile `run(B, L)` (one forward pass on a B x L dummy batch) and fit the cost model.

        `chunk`: the scorer computes logits in chunks of this many positions (adds that term);
        `chunk_rows`: the chunks run over the rows of the whole batch, not of each sequence.
        """
        grid = list(shapes) if shapes is not None else profile_shapes(max_length, max_batch, chunk)
        cost = profile(run, lambda fn: self.measure(fn, f"profile:{name}"), grid, chunk, chunk_rows)
        self.set_cost_model(name, cost)
        self._profile_runs[name] = run
        return cost

    def check_cost_model(self, name: str, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, float, int]]:
        """(B, L, predicted, measured) at `shapes`, measured with the profile run `calibrate` used."""
        run, cost = self._profile_runs[name], self.cost_models[name]
        return [(b, l, cost.predict(b, l), self.measure(lambda b=b, l=l: run(b, l), f"check:{name}")) for b, l in shapes]

    # -- measuring --------------------------------------------------------------------------
    def measure(self, fn: Callable[[], Any], name: str = "measure") -> int:
        """Peak activation bytes of running `fn` in inference mode (tracker on CPU, allocator on CUDA)."""
        with torch.inference_mode():  # what `run` does: no autograd graph is kept
            if self.tracker is not None:
                with self.tracker.window(name) as w, _no_budget(self.tracker):
                    fn()
                return w.peak_increase
            return _cuda_peak(fn, self.device)  # pragma: no cover - CUDA-only path

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

        `forward` returns one value per index it was given, with inputs moved to the model's
        current device. `fallback` (same signature, one index) scores an input off-device when
        even a batch of one runs out of memory; with a simulated device the default fallback is
        `forward` run in host memory (untracked). A model that placement put on the CPU runs in
        host memory too, outside the device budget.
        """
        if not lengths:
            return []
        on_host = False
        # A run named `model[k]` (one of a scorer's several models) is placed with its scorer.
        owner = name.split("[", 1)[0]
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)
            on_host = self.device_for(owner) != self.device or self.placement.decisions[owner].where == "cpu"
        cost = self.cost_model(name)
        budget = float("inf") if (self.budget_bytes is None or on_host) else float(self.budget_bytes)
        if self.tracker is not None and budget != float("inf"):
            # Bytes already live on the simulated device (kept outputs, caches) are not free.
            budget = max(0.0, budget - self.tracker.live_bytes)
        batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch, largest_first=True)
        if self.observer is not None:  # one record per batch the guard runs (the fallback's too)
            forward = self.observer.wrap(name, lengths, forward, cost, on_host)
        if fallback is None and self.tracker is not None:
            def fallback(idx: list[int]) -> Sequence[Any]:
                with _host_memory():
                    return forward(idx)

        def on_oom(rec: OomRecord) -> None:
            self.oom_log.append(rec)
            if self.observer is not None:
                self.observer.on_oom(rec)
            if not rec.injected:
                cost.distrust()
            log.warning(
                "OOM in %s: batch %d x %d (lengths %s) -> %s: %s",
                rec.model, rec.batch, rec.length, rec.lengths[:8], rec.action, rec.message,
            )

        with torch.inference_mode():
            if on_host:
                # Placed on CPU: host memory, no device budget, no injected device OOMs.
                with _host_memory():
                    results = run_guarded(name, batches, lengths, forward, device=torch.device("cpu"),
                                          fallback=None, on_oom=on_oom, injector=None)
            elif self.tracker is not None:
                with self.tracker:
                    results = run_guarded(name, batches, lengths, forward, device=self.device,
                                          fallback=fallback, on_oom=on_oom, injector=self.injector)
            else:
                results = run_guarded(name, batches, lengths, forward, device=self.device,
                                      fallback=fallback, on_oom=on_oom, injector=self.injector)
        return [results[i] for i in range(len(lengths))]

    def summary(self) -> dict:
        """Budget, cost models, OOM counts and placement, JSON-able (for logs and telemetry)."""
        return {
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.tracker.peak_bytes if self.tracker is not None else None,
            "ooms": len(self.oom_log),
            "ooms_injected": sum(r.injected for r in self.oom_log),
            "cost_models": {n: c.to_dict() for n, c in self.cost_models.items()},
            "placement": self.placement.summary() if self.placement is not None else None,
        }


@contextmanager
def _host_memory() -> Iterator[None]:
    """Run outside every dispatch mode: host memory, invisible to the simulated device."""
    with _disable_current_modes():
        yield


@contextmanager
def _no_budget(tracker: TensorBytesTracker) -> Iterator[None]:
    """Lift the tracker's budget inside (profile runs); keep counting."""
    saved = tracker.budget_bytes
    tracker.budget_bytes = None
    try:
        yield
    finally:
        tracker.budget_bytes = saved


def _cuda_peak(fn: Callable[[], Any], device: torch.device) -> int:  # pragma: no cover - CUDA-only path
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - start)
