"""The memory manager: the one object scorers ask to run their forward passes.

One class composed of helpers that own their own state: the card it sizes the budget on
(`sizing.Card`: the device at start and now, memory outside torch, `setup`'s budget), the
calibrator (`calibrating.Calibrator`: model keys, the deferred queue, profiles or cache reads)
and the guarded run's passes (`guarded`: plain functions given what they use). This module holds
the manager's own state: budget, tracker, cost models, placement, OOM log and observers.

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
from collections import deque
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack._memory.budget import Budget, weights_bytes
from rewardstack._memory.calibrating import Calibrator, Profile, measure_peak
from rewardstack._memory.calibration import CalibrationCache
from rewardstack._memory.costmodel import CostModel
from rewardstack._memory.guard import FaultInjector, OomRecord, Outcome
from rewardstack._memory.guarded import Forward, cpu_fallback, prepare_batches, run_batches
from rewardstack._memory.observers import MemoryObserver, PlacementMove, ProfileRecord
from rewardstack._memory.placement import Decision, Placement
from rewardstack._memory.planner import max_fitting_length, plan_batches
from rewardstack._memory.sizing import Card
from rewardstack._memory.snapshot import MemorySnapshot
from rewardstack._memory.tracker import TensorBytesTracker
from rewardstack._models import owner_of

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
        snapshot: Callable[[torch.device], MemorySnapshot] | None = None,
        profile_limit_s: float | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.profile_limit_s = profile_limit_s
        """Time cap of a profile asked for mid-run (`[memory] profile_seconds`; None: none)."""
        self.budget_bytes = budget_bytes
        self.margin = margin
        self.injector = injector
        self.cost_models: dict[str, CostModel] = {}
        # The last OOM_LOG_SIZE records; `ooms_total` / `ooms_injected` count every one.
        self.oom_log: deque[OomRecord] = deque(maxlen=OOM_LOG_SIZE)
        self.ooms_total = 0
        self.ooms_injected = 0
        self.calibration = calibration
        """Fitted cost models by key, beside the config (None: every start profiles)."""
        # CUDA (or a simulated card in tests): the device as it was before any model loaded.
        self.card = Card(self.device, snapshot)
        self.fallbacks_total = 0  # inputs scored by a CPU fallback
        self.placement: Placement | None = None
        self._up_next: str | None = None  # set only inside `prefetching`
        self.budget: Budget | None = None
        self.observers: list[MemoryObserver] = []
        """Subscribers told of runs, batches, OOMs, profiles and placement moves (`subscribe`)."""
        self.calibrator = Calibrator(self.device, self._publish_profile)
        self._registered: dict[str, tuple[list[torch.nn.Module], float, bool]] = {}
        if simulate is None:
            simulate = self.device.type != "cuda"
        self.tracker: TensorBytesTracker | None = TensorBytesTracker(budget_bytes) if simulate else None

    @classmethod
    def for_config(cls, cfg: Any, *, recalibrate: bool = False) -> "MemoryManager":
        """The manager a stack built from `cfg` uses: its device and margin, and the config's
        calibration cache (`[memory] calibration_file`, else in the config's home folder,
        `rewardstack._paths.calibration_file`; none for a config built in code)."""
        from rewardstack._memory.calibration import cache_path_for

        memory = getattr(cfg, "memory", None)
        path = cache_path_for(getattr(cfg, "source", None), getattr(memory, "calibration_file", None))
        cache = CalibrationCache(path, recalibrate=recalibrate) if path is not None or recalibrate else None
        return cls(None, device=torch.device(cfg.device), margin=cfg.safety_margin, calibration=cache,
                   profile_limit_s=getattr(memory, "profile_seconds", None))

    @property
    def startup(self) -> MemorySnapshot | None:
        """The device as it was before any model loaded (None: no card to read)."""
        return self.card.startup

    @property
    def profiled(self) -> list[str]:
        """Names whose cost model was measured in this process (not read from the cache)."""
        return self.calibrator.profiled

    @property
    def calibration_seconds(self) -> float:
        """Seconds spent tuning and profiling."""
        return self.calibrator.seconds

    def describe_model(self, model_cfg: Any) -> None:
        """Record what a scorer's fits depend on (`Calibrator.describe_model`)."""
        self.calibrator.describe_model(model_cfg, self.calibration)

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

    def _publish_profile(self, record: ProfileRecord) -> None:
        for o in list(self.observers):
            o.profiled(record)

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
        if move is None and self.card.injected:
            move = False  # an injected (simulated) card: account, move nothing
        self.placement = Placement(self.device, weights_budget, move=move)
        self.placement.listeners.append(self._publish_move)
        for name, (mods, prio, cpu_ok) in self._registered.items():
            self.placement.register(name, mods, priority=prio, cpu_ok=cpu_ok)
        return self.placement.plan()

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


    # -- sizing the card --------------------------------------------------------------------
    def live_bytes(self) -> int:
        """Activation bytes live on the device now, the same quantity on every device.

        Simulated device: the tracker's count. CUDA: allocated bytes minus the resident weights
        (and minus what was allocated before the stack started). Planning subtracts this from the
        budget, so a prefix cache or another model's kept tensors are never counted as free.
        """
        if self.tracker is not None:
            return self.tracker.live_bytes
        return self.card.allocated_since_start(self.placement.device_bytes() if self.placement is not None else 0)

    def setup(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> Budget:
        """Resolve the budget from a StackConfig (`Card.resolve`, where the rule is written) and
        place the registered models under the weights' share. `total_memory` stands for the card's
        size in tests."""
        seen: dict[int, torch.nn.Module] = {}
        for mods, _, _ in self._registered.values():
            for m in mods:
                seen[id(m)] = m
        weights = weights_bytes(list(seen.values()))
        budget, weights_budget = self.card.resolve(cfg, weights, total_memory=total_memory)
        self.budget = budget
        log.info("memory budget: %s (stack weights %d bytes)", budget.describe(), weights)
        self.set_budget(budget.activation_bytes)
        if self._registered:
            self.place(weights_budget)
        return budget

    def weights_capacity(self, cfg: Any, *, total_memory: Callable[[torch.device], int] | None = None) -> int | None:
        """Device bytes the weights may hold when they do not all fit (None: no card to fill)."""
        return self.card.weights_capacity(cfg, total_memory=total_memory)

    # -- calibration ------------------------------------------------------------------------
    def calibrate(self, profile: Profile) -> CostModel:
        """Fit `profile`'s cost model (a scorer's whole side of calibration: `calibrating.Profile`)
        from measured peaks of its passes, and use it to plan that scorer's batches.

        Every profile that runs is told to the observers (`ProfileRecord`: the telemetry's
        `profiling` records). With a calibration cache and a known model (`describe_model`), a
        fit saved under the same key is reused without profiling. Inside `deferred_calibration()`
        the work is queued until `run_calibrations()`, after placement has put the models where
        they will run.
        """
        name = profile.name

        def work() -> CostModel:
            # The cache and the tracker as they are when the work runs (the queue runs after setup).
            cost = self.calibrator.fit(profile, self.calibration, self.tracker)
            self.set_cost_model(name, cost)
            return cost

        if self.calibrator.queue(name, work):
            # Keep the name taken (a checkpoint shared by two scorers is profiled once).
            return self.cost_models.setdefault(name, CostModel())
        self._ensure_placed(name)  # a profile after start-up (DPO's smaller chunk) runs where scoring does
        return work()

    def _ensure_placed(self, name: str) -> None:
        """Bring `name`'s model (its owner's) where it runs, if placement manages it."""
        owner = owner_of(name)
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)

    @contextmanager
    def deferred_calibration(self) -> Iterator[None]:
        """Queue `calibrate` calls made inside (models load on the host first; see `run_calibrations`)."""
        with self.calibrator.deferred():
            yield

    def run_calibrations(self) -> list[str]:
        """Run the queued calibrations, each with its model on the device it will run on.

        A model placement swaps is brought in for its profile (evicting as scoring would); a model
        placed on the CPU is profiled there. Afterwards memory that appeared outside torch (cuBLAS
        workspaces appear at the first matmul) is measured and taken off the activation budget.
        Returns the names calibrated.
        """
        if self.placement is None and self._registered:
            self.place(None)  # no setup (a manager handed in): every model resident, moved there now
        done = self.calibrator.run_queue(self._ensure_placed)
        if self.budget is not None and self.card.charge_growth(self.budget):
            self.set_budget(self.budget.activation_bytes)
        if self.calibration is not None:
            log.info("calibration: %d profiled (%.1fs), %d read from %s", len(self.profiled),
                     self.calibration_seconds, self.calibration.hits, self.calibration.path)
        return done

    def check_cost_model(self, name: str, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, float, int]]:
        """(B, L, predicted, measured) at `shapes`, measured with the profile run `calibrate` used."""
        run, cost = self.calibrator.profile_runs[name], self.cost_models[name]
        return [(b, l, cost.predict(b, l), self.measure(lambda b=b, l=l: run(b, l), f"check:{name}")) for b, l in shapes]

    def measure(self, fn: Callable[[], Any], name: str = "measure") -> int:
        """Peak activation bytes of running `fn` in inference mode (tracker on CPU, allocator on CUDA)."""
        return measure_peak(fn, name, self.tracker, self.device)

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Forward,
        *,
        max_batch: int | None = None,
        fallback: Forward | None = None,
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
            if not lengths:
                return []
            # A run named `model[k]` (one of a scorer's several models) is placed with its scorer.
            owner = owner_of(name)
            on_host = self._bring_in(owner)
            cost = self.cost_model(name)
            if prepare is not None:
                prepare_batches(name, prepare, device=self.device, on_host=on_host, tracker=self.tracker)
            budget = float("inf") if (self.budget_bytes is None or on_host) else float(self.budget_bytes)
            if budget != float("inf"):
                # Bytes already live on the device (kept outputs, prefix caches) are not free.
                budget = max(0.0, budget - self.live_bytes())
            batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch, largest_first=True,
                                   slack=slack, prefix=prefix)
            for o in list(self.observers):  # e.g. one telemetry record per batch the guard runs (the fallback's too)
                forward = o.batch(name, lengths, forward, cost, on_host, prefix=prefix, completions=completions)
            if fallback is None and not on_host and self._cpu_ok(owner):
                fallback = cpu_fallback(owner, forward, self.placement, self._count_fallback)
            results = run_batches(name, batches, lengths, forward, cost=cost, device=self.device, on_host=on_host,
                                  tracker=self.tracker, injector=self.injector, fallback=fallback,
                                  on_oom=self._record_oom)
            return [results[i] for i in range(len(lengths))]

    @property
    def up_next(self) -> str | None:
        """The model the stack runs after the current one (inside `prefetching`; else None)."""
        return self._up_next

    @contextmanager
    def prefetching(self, up_next: str | None) -> Iterator[None]:
        """Inside: the model the caller runs next is `up_next`, prefetched once each current model
        is placed (so its weights' copy overlaps the current one's passes). Scoped, so a pass
        outside (a profile between steps) prefetches nothing."""
        saved, self._up_next = self._up_next, up_next
        try:
            yield
        finally:
            self._up_next = saved

    def _bring_in(self, owner: str) -> bool:
        """Put `owner` where it runs and start prefetching the model up next; True when it runs on
        the host (placed on the CPU)."""
        if self.placement is None or owner not in self.placement.names():
            return False
        self.placement.ensure(owner)
        on_host = self.device_for(owner) != self.device or self.placement.decisions[owner].where == "cpu"
        nxt = self._up_next
        if nxt is not None and nxt != owner and nxt in self.placement.names():
            # After this model is on the card, so the copy cannot evict it: on CUDA with pinned
            # host copies the next model's weights move on the side stream while this one
            # computes; elsewhere `prefetch` declines and `ensure` moves it when it runs.
            self.placement.prefetch(nxt)
        return on_host

    def _record_oom(self, rec: OomRecord) -> None:
        self.oom_log.append(rec)
        self.ooms_total += 1
        self.ooms_injected += int(rec.injected)
        for o in list(self.observers):
            o.oom(rec)

    def _count_fallback(self) -> None:
        self.fallbacks_total += 1

    def _cpu_ok(self, owner: str) -> bool:
        reg = self._registered.get(owner)
        return bool(reg and reg[2])

def check_device(name: str) -> torch.device:
    """`name` as a torch device this torch build and machine can use, or a ConfigError naming the
    device and the build (one line): checked before any model loads, where the first CUDA call
    would otherwise end in torch's `AssertionError: Torch not compiled with CUDA enabled`."""
    from rewardstack.errors import ConfigError

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError("device", f"{name!r} is not a torch device (cpu, cuda, cuda:0, mps, ...): {e}") from e
    build = f"torch {torch.__version__}"
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ConfigError("device", f"{name} cannot be used: this {build} was built without CUDA; set "
                                        "device = \"cpu\", or install a CUDA build of torch into the venv")
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{name} cannot be used: {build} (CUDA {torch.version.cuda}) finds no CUDA "
                                        "device on this machine; set device = \"cpu\"")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError("device", f"{name} cannot be used: this machine has {count} CUDA device(s) "
                                        f"(cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device", f"{name} cannot be used: {build} finds no Apple MPS device here; set device = \"cpu\"")
    return dev

