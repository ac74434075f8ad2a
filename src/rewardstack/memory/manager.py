"""The memory manager: the one object scorers ask to run their forward passes.

It owns the budget, the tracker (simulated device on CPU), the per-model cost models, the OOM log
and (when the stack's weights do not fit) the placement. `run` plans batches from token lengths,
makes sure the model is on its device, runs the batches under the OOM guard and returns outcomes in
input order. `length_cap` tells a scorer how long one input may be and still fit alone.

The stack's order of calls (place, then load onto the card, then profile):
  configure_allocator(); mm = MemoryManager(None, device=...)   # CUDA: free memory read now
  with mm.deferred_calibration(): build scorers                  # weights load on the host;
                                                                 # their `calibrate` calls queue
  mm.register_model(name, modules) per model; mm.setup(cfg)      # budget; placement moves only
                                                                 # the resident models to the card
  mm.run_calibrations()                                          # profile on the device (or read
                                                                 # the calibration cache); score.

One accounting on every device: a batch is planned against the activation budget minus the bytes
live now (`live_bytes`: the tracker's count on the simulated device; on CUDA the allocator's
allocated bytes minus the resident weights), so a prefix cache or another model's buffers are never
counted as free.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from rewardstack.memory.budget import (
    ACTIVATION_SHARE,
    Budget,
    DeviceSnapshot,
    compute_budget,
    split_card,
    cuda_allocated,
    cuda_snapshot,
    cuda_total_memory,
    weights_bytes,
)
from rewardstack.memory.calibration import CalibrationCache, calibration_key, environment
from rewardstack.memory.costmodel import CostModel, profile, profile_shapes
from rewardstack.memory.guard import FaultInjector, OomRecord, Outcome, free_device_memory, run_guarded
from rewardstack.memory.observers import MemoryObserver, PlacementMove
from rewardstack.memory.peaks import PeakWindow
from rewardstack.memory.placement import Decision, Placement
from rewardstack.memory.planner import max_fitting_length, plan_batches
from rewardstack.memory.tracker import TensorBytesTracker

log = logging.getLogger("rewardstack.memory")

# OOM records kept in memory (a ring buffer); totals are counted without limit.
OOM_LOG_SIZE = 256


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
        calibration: CalibrationCache | None = None,
        snapshot: Callable[[torch.device], DeviceSnapshot] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.margin = margin
        self.injector = injector
        self.cost_models: dict[str, CostModel] = {}
        # The last OOM_LOG_SIZE records; `ooms_total` / `ooms_injected` count every one.
        self.oom_log: deque[OomRecord] = deque(maxlen=OOM_LOG_SIZE)
        self.ooms_total = 0
        self.ooms_injected = 0
        # Fitted cost models by key, beside the config (None: every start profiles).
        self.calibration = calibration
        self.model_keys: dict[str, dict[str, Any]] = {}  # scorer name -> what its fit depends on
        self.profiled: list[str] = []  # names whose cost model was measured in this process
        self.calibration_seconds = 0.0
        self._pending: list[tuple[str, Callable[[], CostModel]]] | None = None
        # CUDA (or a simulated card in tests): the device as it was before any model loaded.
        self._snapshot = snapshot
        self.startup: DeviceSnapshot | None = None
        if snapshot is not None or self.device.type == "cuda":
            self.startup = self.snapshot()
            log.info("device at start: %s", self.startup.describe())
        self.non_torch_bytes = 0
        self.fallbacks_total = 0  # inputs scored by a CPU fallback
        self.placement: Placement | None = None
        self.budget: Budget | None = None
        # Telemetry (rewardstack.telemetry.monitor.Monitor): sees every batch the guard runs and
        # every OOM; None: nothing is recorded.
        self.observers: list[MemoryObserver] = []
        """Subscribers told of runs, batches, OOMs and placement moves (`subscribe`)."""
        self._registered: dict[str, tuple[list[torch.nn.Module], float, bool]] = {}
        self._profile_runs: dict[str, Callable[[int, int], Any]] = {}
        if simulate is None:
            simulate = self.device.type != "cuda"
        self.tracker: TensorBytesTracker | None = TensorBytesTracker(budget_bytes) if simulate else None

    @classmethod
    def for_config(cls, cfg: Any, *, recalibrate: bool = False) -> "MemoryManager":
        """The manager a stack built from `cfg` uses: its device and margin, and the calibration
        cache beside the config file (`<config>.calibration.json`; none for a config built in code)."""
        from rewardstack.memory.calibration import cache_path_for

        path = cache_path_for(getattr(cfg, "source", None))
        cache = CalibrationCache(path, recalibrate=recalibrate) if path is not None or recalibrate else None
        return cls(None, device=torch.device(cfg.device), margin=cfg.safety_margin, calibration=cache)

    def describe_model(self, model_cfg: Any) -> None:
        """Record what a scorer's fits depend on (its config entry, and local checkpoints' files),
        the model part of its calibration key."""
        from dataclasses import asdict

        d = {k: v for k, v in asdict(model_cfg).items() if k not in ("weight", "enabled")}
        d["files"] = _fingerprint([p for p in [model_cfg.path, *model_cfg.paths] if p])
        self.model_keys[model_cfg.name] = d

    # -- observers --------------------------------------------------------------------------
    def subscribe(self, observer: MemoryObserver) -> None:
        """Tell `observer` of every run, batch, OOM and placement move from now on."""
        if observer not in self.observers:
            self.observers.append(observer)

    def unsubscribe(self, observer: MemoryObserver) -> None:
        """Stop telling `observer` (no error if it was not subscribed)."""
        if observer in self.observers:
            self.observers.remove(observer)

    def _publish_move(self, move: PlacementMove) -> None:
        for o in list(self.observers):
            o.moved(move)

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
        if move is None and self._snapshot is not None:
            move = False  # an injected (simulated) card: account, move nothing
        self.placement = Placement(self.device, weights_budget, move=move)
        self.placement.listeners.append(self._publish_move)
        for name, (mods, prio, cpu_ok) in self._registered.items():
            self.placement.register(name, mods, priority=prio, cpu_ok=cpu_ok)
        return self.placement.plan()

    def snapshot(self) -> DeviceSnapshot:
        """The device's memory now (CUDA, or the injected simulated card of tests)."""
        return (self._snapshot or cuda_snapshot)(self.device)

    def measure_non_torch(self) -> int:
        """Bytes used on the device since start outside torch's allocator (vLLM's "used by the process
        minus reserved"): CUDA context growth, cuBLAS/cuDNN workspaces. 0 without a device."""
        if self.startup is None:
            return 0
        now = self.snapshot()
        grown = (now.total - now.free) - (self.startup.total - self.startup.free)
        self.non_torch_bytes = max(0, grown - (now.reserved - self.startup.reserved))
        return self.non_torch_bytes

    def live_bytes(self) -> int:
        """Activation bytes live on the device now, the same quantity on every device.

        Simulated device: the tracker's count. CUDA: allocated bytes minus the resident weights
        (and minus what was allocated before the stack started). Planning subtracts this from the
        budget, so a prefix cache or another model's kept tensors are never counted as free.
        """
        if self.tracker is not None:
            return self.tracker.live_bytes
        if self.startup is None:
            return 0
        allocated = self.snapshot().allocated if self._snapshot is not None else cuda_allocated(self.device)
        resident = self.placement.device_bytes() if self.placement is not None else 0
        return max(0, allocated - resident - self.startup.allocated)

    def card_bytes(self, cfg: Any, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """The size of the card the stack behaves as on: `[memory] device_memory` when set (never
        more than the real card), else the real card; on CPU `device_memory` sizes the simulated
        device, and without it there is none (None)."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if total_memory is not None:
            total: int | None = int(total_memory(self.device))
        elif self.startup is not None:
            total = self.startup.total
        elif self.device.type == "cuda":  # pragma: no cover - CUDA-only path
            total = cuda_total_memory(self.device)
        else:
            return int(dm) if dm else None
        return min(total, int(dm)) if dm else total

    def setup(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> Budget:
        """Resolve the budget from a StackConfig and place the registered models.

        With a card (CUDA, `[memory] device_memory`, or `total_memory` in tests): usable = card x
        gpu_utilization - headroom, on CUDA also at most what was free at start, minus memory
        measured outside torch. If the weights fit in usable minus an activation share, all are
        resident and activations get the rest (or `memory_budget`); otherwise weights get
        (1 - ACTIVATION_SHARE) of usable, placed by `Placement`. On CUDA with `device_memory`
        the allocator is also capped there (`set_per_process_memory_fraction`).
        CPU without `device_memory`: `memory_budget` is both the activation budget the tracker
        enforces and the size of the simulated device the weights are placed into; None: unlimited.
        """
        seen: dict[int, torch.nn.Module] = {}
        for mods, _, _ in self._registered.values():
            for m in mods:
                seen[id(m)] = m
        weights = weights_bytes(list(seen.values()))
        card = self.card_bytes(cfg, total_memory)
        if card is not None:
            usable = int(card * cfg.gpu_utilization) - cfg.headroom_bytes
            free_at_start = None
            if self.startup is not None:
                # Another process's memory is not ours: never plan past what was free at start.
                free_at_start = self.startup.free + self.startup.reserved
                usable = min(usable, free_at_start - cfg.headroom_bytes) - self.measure_non_torch()
                self._cap_allocator(cfg, card)
            weights_budget, act = split_card(usable, weights, cfg.memory_budget)
            budget = Budget(str(self.device), int(act), "config" if cfg.memory_budget is not None else "device",
                            card, cfg.gpu_utilization, weights, cfg.headroom_bytes, free_at_start, self.non_torch_bytes)
        else:
            budget = compute_budget(cfg, self.device, weights)
            weights_budget = cfg.memory_budget
        self.budget = budget
        log.info("memory budget: %s (stack weights %d bytes)", budget.describe(), weights)
        self.set_budget(budget.activation_bytes)
        if self._registered:
            self.place(weights_budget)
        return budget

    def _cap_allocator(self, cfg: Any, card: int) -> None:
        """`[memory] device_memory` on CUDA: a hard cap, so the allocator fails where that card would."""
        dm = getattr(getattr(cfg, "memory", None), "device_memory", None)
        if not dm or self.device.type != "cuda" or self._snapshot is not None:
            return
        fraction = min(1.0, card / self.startup.total)  # type: ignore[union-attr]  # pragma: no cover - CUDA-only path
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)  # pragma: no cover - CUDA-only path
        log.info("allocator capped at %.3f of the card (device_memory %d bytes)", fraction, card)  # pragma: no cover

    def weights_capacity(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """Device bytes the weights may hold when they do not all fit (None: no card to fill).

        The share `setup` gives weights when they do not all fit: usable x (1 - ACTIVATION_SHARE).
        """
        card = self.card_bytes(cfg, total_memory)
        if card is None:
            return None
        usable = int(card * cfg.gpu_utilization) - cfg.headroom_bytes
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
        budget = max(0.0, float(self.budget_bytes) - self.live_bytes())  # as `run` plans: live bytes are not free
        return max(1, max_fitting_length(self.cost_model(name), budget, self.margin, upper))

    def calibrate(
        self,
        name: str,
        run: Callable[[int, int], Any],
        *,
        max_length: int,
        max_batch: int = 8,
        shapes: Sequence[tuple[int, int]] | Callable[[dict[str, Any]], Sequence[tuple[int, int]]] | None = None,
        chunk: int | None = None,
        chunk_rows: bool = False,
        max_tokens: int | None = None,
        tune: Callable[[], dict[str, Any]] | None = None,
        apply: Callable[[dict[str, Any]], None] | None = None,
    ) -> CostModel:
        """Profile `run(B, L)` (one forward pass on a B x L dummy batch) and fit the cost model.

        `run` must take the scorer's own path (its prefix cache, its penalty): the fit is only as
        good as the passes it measured. The planner admits nothing past the largest profiled shape,
        so `max_length` should be the longest input the scorer admits. `max_tokens` drops shapes
        wider than that (B*L) from the default grid (and caps batches there).
        `chunk`: the scorer computes logits in chunks of this many positions (adds that term);
        `chunk_rows`: the chunks run over the rows of the whole batch, not of each sequence.
        `tune()`: settings measured before profiling (e.g. DPO's logits chunk, {"chunk": 128});
        `apply(settings)` hands them, or the cached ones, back to the scorer.
        `shapes` may be a function of those settings (a tuned pass size decides how wide the
        profiled batches must reach); its qualified name then stands for it in the cache key.

        With a calibration cache and a known model (`model_keys`), a fit saved under the same key
        is reused without profiling. Inside `deferred_calibration()` the work is queued until
        `run_calibrations()`, after placement has put the models where they will run.
        """
        grid_of = shapes if callable(shapes) else None
        grid = list(shapes) if shapes is not None and grid_of is None else None  # type: ignore[arg-type]
        if grid is None and grid_of is None and max_tokens is None:
            max_tokens = int(max_length)  # batches up to one longest input's tokens (TEI-like)
        args = {"max_length": int(max_length), "max_batch": int(max_batch),
                "shapes": grid_of.__qualname__ if grid_of is not None else grid, "chunk": chunk,
                "chunk_rows": chunk_rows, "max_tokens": max_tokens, "tuned": tune is not None}

        def work() -> CostModel:
            key = self._calibration_key(name, args)
            entry = self.calibration.get(key) if (self.calibration is not None and key is not None) else None
            if entry is not None:
                cost = CostModel.from_dict(entry["cost"])
                if apply is not None:
                    apply(dict(entry.get("settings", {})))
                log.info("cost model for %s read from the calibration cache: %s", name, cost.describe())
            else:
                started = time.perf_counter()
                settings = {}
                if tune is not None:  # timing passes, not a scoring pass: the budget does not bound them
                    with torch.inference_mode(), _no_budget(self.tracker) if self.tracker is not None else nullcontext():
                        settings = tune()
                if apply is not None:
                    apply(dict(settings))
                use_chunk = settings.get("chunk", chunk)
                if grid_of is not None:
                    shapes_ = list(grid_of(settings))
                else:
                    shapes_ = grid if grid is not None else profile_shapes(max_length, max_batch, use_chunk, max_tokens)
                cost = profile(run, lambda fn: self.measure(fn, f"profile:{name}"), shapes_, use_chunk, chunk_rows)
                self.profiled.append(name)
                self.calibration_seconds += time.perf_counter() - started
                if self.calibration is not None and key is not None:
                    self.calibration.put(key, {"name": name, "cost": cost.to_dict(), "settings": settings})
            self.set_cost_model(name, cost)
            self._profile_runs[name] = run
            return cost

        if self._pending is not None:
            # Keep the name taken (a checkpoint shared by two scorers is profiled once).
            self.cost_models.setdefault(name, CostModel())
            self._pending.append((name, work))
            return self.cost_models[name]
        owner = name.split("[", 1)[0]
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)  # a profile after start-up (DPO's smaller chunk) runs where scoring does
        return work()

    def _calibration_key(self, name: str, args: dict[str, Any]) -> str | None:
        owner = name.split("[", 1)[0]
        model = self.model_keys.get(name, self.model_keys.get(owner))
        if model is None:
            return None
        return calibration_key({"scorer": name, **model}, args, environment(self.device))

    @contextmanager
    def deferred_calibration(self) -> Iterator[None]:
        """Queue `calibrate` calls made inside (models load on the host first; see `run_calibrations`)."""
        self._pending = []
        try:
            yield
        except BaseException:
            self._pending = None
            raise

    def run_calibrations(self) -> list[str]:
        """Run the queued calibrations, each with its model on the device it will run on.

        A model placement swaps is brought in for its profile (evicting as scoring would); a model
        placed on the CPU is profiled there. Afterwards memory that appeared outside torch (cuBLAS
        workspaces appear at the first matmul) is measured and taken off the activation budget.
        Returns the names calibrated.
        """
        pending, self._pending = self._pending or [], None
        if self.placement is None and self._registered:
            self.place(None)  # no setup (a manager handed in): every model resident, moved there now
        done = []
        for name, work in pending:
            owner = name.split("[", 1)[0]
            if self.placement is not None and owner in self.placement.names():
                self.placement.ensure(owner)
            work()
            done.append(name)
        if self.startup is not None and self.budget is not None and self.budget.activation_bytes is not None:
            before = self.budget.non_torch_bytes
            grown = self.measure_non_torch() - before
            if grown > 0 and self.budget.source != "config":
                self.budget.non_torch_bytes = self.non_torch_bytes
                self.budget.activation_bytes = max(0, self.budget.activation_bytes - grown)
                log.info("memory outside torch grew by %d bytes while profiling: %s", grown, self.budget.describe())
                self.set_budget(self.budget.activation_bytes)
        if self.calibration is not None:
            log.info("calibration: %d profiled (%.1fs), %d read from %s", len(self.profiled),
                     self.calibration_seconds, self.calibration.hits, self.calibration.path)
        return done

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
        prepare: Callable[[], Any] | None = None,
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
        """
        with ExitStack() as observed:
            for o in list(self.observers):  # e.g. replay's per-model peak window
                observed.enter_context(o.run(name, lengths))
            return self._run(name, lengths, forward, max_batch=max_batch, fallback=fallback, prepare=prepare)

    def _run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Callable[[list[int]], Sequence[Any]],
        *,
        max_batch: int | None,
        fallback: Callable[[list[int]], Sequence[Any]] | None,
        prepare: Callable[[], Any] | None,
    ) -> list[Outcome]:
        if not lengths:
            return []
        on_host = False
        # A run named `model[k]` (one of a scorer's several models) is placed with its scorer.
        owner = name.split("[", 1)[0]
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)
            on_host = self.device_for(owner) != self.device or self.placement.decisions[owner].where == "cpu"
        cost = self.cost_model(name)
        if prepare is not None:
            self._prepare(name, prepare, on_host)
        budget = float("inf") if (self.budget_bytes is None or on_host) else float(self.budget_bytes)
        if budget != float("inf"):
            # Bytes already live on the device (kept outputs, prefix caches) are not free.
            budget = max(0.0, budget - self.live_bytes())
        batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch, largest_first=True)
        for o in list(self.observers):  # e.g. one telemetry record per batch the guard runs (the fallback's too)
            forward = o.batch(name, lengths, forward, cost, on_host)
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

    def summary(self) -> dict:
        """Budget, cost models, OOM counts and placement, JSON-able (for logs and telemetry)."""
        return {
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.tracker.peak_bytes if self.tracker is not None else None,
            "ooms": self.ooms_total,
            "ooms_injected": self.ooms_injected,
            "cpu_fallbacks": self.fallbacks_total,
            "profiled": list(self.profiled),
            "calibration_seconds": self.calibration_seconds,
            "cost_models": {n: c.to_dict() for n, c in self.cost_models.items()},
            "placement": self.placement.summary() if self.placement is not None else None,
        }


def _fingerprint(paths: Sequence[str]) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the weight and config files of local checkpoint folders: a checkpoint
    rewritten in place changes the calibration key (hub ids are pinned by revision instead)."""
    from pathlib import Path

    out: list[tuple[str, int, int]] = []
    for p in paths:
        folder = Path(p)
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".pt", ".json") and f.is_file():
                st = f.stat()
                out.append((f"{folder.name}/{f.name}", st.st_size, int(st.st_mtime)))
    return out


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
    with PeakWindow(device, None) as w:  # nestable: an open telemetry or replay window keeps its peak
        fn()
        torch.cuda.synchronize(device)
    return int(w.peak_increase or 0)
