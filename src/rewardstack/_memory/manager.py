"""The memory manager: the one object scorers ask to run their forward passes, and what it tells subscribers.

It owns the budget (sized on the `Card`), the tracker (the simulated device on CPU), the per-model
cost models, the OOM log, what calibration did and (when the stack's weights do not fit) the placement.
`run` plans batches from token lengths, makes sure the model is where it runs, runs the batches
under the OOM guard and returns outcomes in input order. `length_cap` tells a scorer how long one
input may be and still fit alone.

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

The memory layer knows nothing of who listens (telemetry, replay, a benchmark): a subscriber
derives from `MemoryObserver`, overrides the hooks it needs and is added with `subscribe`. Hooks
run inside the scoring loop and must never raise into it.

- `run(name, lengths)`: a context manager around one `MemoryManager.run` call (placement, the
  shared prefix, every batch): replay's per-model peak.
- `batch(name, lengths, forward, cost, on_host, prefix=, completions=)`: returns the forward function
  to run for each batch the guard runs (split halves and CPU fallbacks included), e.g. `forward`
  timed and measured: the telemetry's call records. `completions` names each input by the step's
  completion index (the scorer's own numbering skips and merges inputs), None for the prompt.
- `oom(record)`: an out-of-memory error the guard handled (`guard.OomRecord`, with what it did next).
- `moved(move)`: placement moved a model's weights onto the device or off it (`placement.PlacementMove`).
- `profiled(record)`: a profile ran (`calibration.ProfileRecord`, with how long it took): at load,
  never inside a request (`serving`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack._memory.budget import Budget, Card, weights_bytes
from rewardstack._memory.calibration import (CalibrationCache, CpuShare, Profile, ProfileRecord, cache_path_for,
                                             calibration_key, checkpoint_identity, machine_quiet, measure_peak,
                                             no_budget)
from rewardstack._memory.costmodel import CostModel, max_fitting_length, plan_batches, plan_limit, profile
from rewardstack._memory.device import MemorySnapshot, TensorBytesTracker
from rewardstack._memory.guard import Forward, OomRecord, Outcome, cpu_fallback, prepare_batches, run_guarded, where_run
from rewardstack._memory.placement import Decision, Placement, PlacementMove
from rewardstack._models import owner_of

log = logging.getLogger("rewardstack.memory")


class MemoryObserver:
    """A subscriber of the memory layer; every hook does nothing unless overridden."""

    def run(self, name: str, lengths: Sequence[int]) -> AbstractContextManager[Any]:
        """Context around one `MemoryManager.run` call of model run `name`."""
        return nullcontext()

    def batch(self, name: str, lengths: Sequence[int], forward: Forward, cost: CostModel,
              on_host: bool, prefix: int = 0, completions: Sequence[int | None] | None = None) -> Forward:
        """The forward function to run each batch of this run with (default: `forward` as is).

        `prefix`: the inputs' shared prefix tokens, run before the batches (the prediction of a
        batch is `cost.predict(B, L, prefix)`). `completions`: input j is the step's completion
        `completions[j]` (None: the prompt); None when the caller did not say."""
        return forward

    def oom(self, record: OomRecord) -> None:
        """An OOM the guard handled."""

    def moved(self, move: PlacementMove) -> None:
        """A placement move."""

    def profiled(self, record: ProfileRecord) -> None:
        """A profile ran (at load: never inside a request)."""


@dataclass
class Allowance:
    """What the budget allows one pass (`MemoryManager.run_pass`): inputs of at most `cap` tokens
    (the longest predicted to fit alone), planned with the cost model of `setting`."""

    cap: int
    setting: str


@dataclass
class Pass:
    """The inputs a scorer builds within an `Allowance`: their token lengths, the forward function
    that scores a batch of them, and what `MemoryManager.run` takes with them."""

    lengths: Sequence[int]
    forward: Forward
    max_batch: int | None = None
    prepare: Callable[[], Any] | None = None
    slack: float | None = None
    prefix: int = 0
    completions: Sequence[int | None] | None = None
    rows: Callable[[int, int], int] | None = None
    """The rows a batch of (count, longest) runs as, filler rows included (`plan_batches(rows=)`)."""


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
        injector: Any = None,
        calibration: CalibrationCache | None = None,
        snapshot: Callable[[torch.device], MemorySnapshot] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.margin = margin
        self.injector = injector
        """Raises OOMs inside passes on purpose (the soak's `FaultInjector`, tests/soak/faults.py; None: none)."""
        self.cost_models: dict[str, CostModel] = {}
        # The last OOM_LOG_SIZE records; `ooms_total` counts every one.
        self.oom_log: deque[OomRecord] = deque(maxlen=OOM_LOG_SIZE)
        self.ooms_total = 0
        self.calibration = calibration
        """Fitted cost models by key, beside the config (None: every start profiles)."""
        # CUDA (or a simulated card in tests): the device as it was before any model loaded.
        self.card = Card(self.device, snapshot)
        self.placement: Placement | None = None
        self._serving = False  # inside `serving`: a request is being scored, no profile may run
        self.budget: Budget | None = None
        self.observers: list[MemoryObserver] = []
        """Subscribers told of runs, batches, OOMs, profiles and placement moves (`subscribe`)."""
        self.model_keys: dict[str, dict[str, Any]] = {}  # scorer name -> what its fit depends on (`describe_model`)
        self.profiled: list[str] = []
        """Names whose cost model was measured in this process (not read from the cache)."""
        self.calibration_seconds = 0.0
        """Seconds spent tuning and profiling (a cache read costs none)."""
        self.profile_runs: dict[str, Callable[[int, int], Any]] = {}  # the run each fit measured
        self._pending: list[tuple[str, Callable[[], CostModel]]] | None = None  # inside `deferred_calibration`
        self._registered: dict[str, tuple[list[torch.nn.Module], bool]] = {}
        self._keys: dict[str, str | None] = {}  # name -> its fit's calibration key (`remembered`)
        self._expected: str | None = None  # the model that runs next (`expect`)
        simulated = self.device.type != "cuda"  # the tracker is the device off CUDA
        self.tracker: TensorBytesTracker | None = TensorBytesTracker(budget_bytes) if simulated else None

    @classmethod
    def for_config(cls, cfg: Any, *, recalibrate: bool = False) -> "MemoryManager":
        """The manager a stack built from `cfg` uses: its device and margin, and the config's
        calibration cache (`[memory] calibration_file`, else in the config's home folder,
        `rewardstack._paths.calibration_file`; none for a config built in code)."""
        path = cache_path_for(cfg.source, cfg.memory.calibration_file)
        cache = CalibrationCache(path, recalibrate=recalibrate) if path is not None or recalibrate else None
        return cls(None, device=torch.device(cfg.device), margin=cfg.safety_margin, calibration=cache)

    def describe_model(self, model_cfg: Any) -> None:
        """Record what a scorer's fits depend on, the model part of its calibration key: its
        checkpoints by content (`calibration.checkpoint_identity`, not where they sit, so another
        config or folder with the same checkpoint shares the fit) and its settings."""
        d = {k: v for k, v in model_cfg.model_dump().items() if k not in ("weight", "enabled", "path", "paths")}
        cache = self.calibration
        if cache is not None:  # hashing the checkpoint serves the cache only
            d["checkpoints"] = [checkpoint_identity(p, cache) for p in [model_cfg.path, *model_cfg.paths] if p]
            cache.save()  # digests of new files: not read again at the next start
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

    def _publish(self, hook: str, *args: Any) -> None:
        for o in list(self.observers):
            getattr(o, hook)(*args)

    # -- budget and placement ---------------------------------------------------------------
    def set_budget(self, budget_bytes: int | None) -> None:
        """Change the activation budget (and the simulated device's limit)."""
        self.budget_bytes = budget_bytes
        if self.tracker is not None:
            self.tracker.budget_bytes = budget_bytes
        log.info("activation budget: %s", "unlimited" if budget_bytes is None else f"{budget_bytes} bytes")

    def register_model(self, name: str, modules: list[torch.nn.Module], *, cpu_ok: bool = False) -> None:
        """Declare a model's modules (for weight accounting and placement). `cpu_ok`: may run on CPU."""
        self._registered[name] = (list(modules), cpu_ok)
        if self.placement is not None:
            self.placement.register(name, list(modules), cpu_ok=cpu_ok)

    def place(self, weights_budget: int | None) -> dict[str, Decision]:
        """Plan placement of the registered models under a weight budget (bytes on the device)."""
        # An injected (simulated) card: account, move nothing.
        self.placement = Placement(self.device, weights_budget, move=False if self.card.injected else None)
        self.placement.on_move = lambda move: self._publish("moved", move)
        for name, (mods, cpu_ok) in self._registered.items():
            self.placement.register(name, mods, cpu_ok=cpu_ok)
        return self.placement.plan()

    def expect(self, name: str | None) -> None:
        """Say which model runs after the next one: with pinned swaps on a card, the next `run` starts
        its swap-in on a side stream once its own model is on the card, so the copy overlaps that
        model's passes (`Placement.prefetch`). Elsewhere (CPU, pageable moves) nothing changes."""
        self._expected = name

    def _prefetch_expected(self, owner: str) -> None:
        """Start the expected model's swap-in beside `owner`'s passes (once per `expect`)."""
        name, self._expected = self._expected, None
        p = self.placement
        if name is None or p is None or p.swapper is None or owner not in p.names():
            return
        if owner_of(name) != owner and owner_of(name) in p.names():  # pragma: no cover - CUDA-only
            p.prefetch(owner_of(name), busy=owner)

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
        return max(1, max_fitting_length(self.cost_model(name), self.free_bytes(), self.margin, upper))

    def free_bytes(self) -> float:
        """What a plan may fill now: the activation budget minus the bytes live on the device (kept
        outputs, prefix caches are not free); unlimited without a budget."""
        if self.budget_bytes is None:
            return float("inf")
        return max(0.0, float(self.budget_bytes) - self.live_bytes())

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

    def setup(self, cfg: Any) -> Budget:
        """Resolve the budget from a StackConfig (`Card.resolve`, where the rule is written) and
        place the registered models under the weights' share."""
        # A module registered by two models counts once, as each storage does (`weights_bytes`).
        weights = weights_bytes([m for mods, _ in self._registered.values() for m in mods])
        budget, weights_budget = self.card.resolve(cfg, weights)
        self.budget = budget
        log.info("memory budget: %s (stack weights %d bytes)", budget.describe(), weights)
        self.set_budget(budget.activation_bytes)
        if self._registered:
            self.place(weights_budget)
        return budget

    # -- calibration ------------------------------------------------------------------------
    def calibrate(self, profile: Profile) -> CostModel:
        """Fit `profile`'s cost model (a scorer's whole side of calibration: `calibration.Profile`)
        from measured peaks of its passes, and use it to plan that scorer's batches.

        Every profile that runs is told to the observers (`ProfileRecord`: the telemetry's
        `profiling` records). With a calibration cache and a known model (`describe_model`), a
        fit saved under the same key is reused without profiling. Inside `deferred_calibration()`
        the work is queued until `run_calibrations()`, after placement has put the models where
        they will run. Never inside a request (`serving`): a profile there would stall the step for
        its duration, so one asked for is refused (RuntimeError).
        """
        if self._serving:
            raise RuntimeError(f"{profile.name}: no profile runs inside a request; calibrate at load")
        name = profile.name

        def work() -> CostModel:
            # The cache and the tracker as they are when the work runs (the queue runs after setup).
            cost = self._fit(profile)
            self.set_cost_model(name, cost)
            if profile.then is not None:
                profile.then()
            return cost

        if self._pending is not None:
            self._pending.append((name, work))
            # Keep the name taken (a checkpoint shared by two scorers is profiled once).
            return self.cost_model(name)
        self._bring_in(owner_of(name))  # a profile after start-up (DPO's smaller chunk) runs where scoring does
        return work()

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
        if self.placement is None and self._registered:
            self.place(None)  # no setup (a manager handed in): every model resident, moved there now
        pending, self._pending = self._pending or [], None
        if pending:
            log.info("calibrating %d model(s): each one's memory cost, profiled or read from the cache", len(pending))
        from tqdm import tqdm  # per-model progress on a terminal (off when stderr is not one)

        bar = tqdm(pending, desc="calibrating", unit="model", file=sys.stderr, disable=None, leave=False)
        for name, work in bar:
            bar.set_postfix_str(name)
            self._bring_in(owner_of(name))
            t0 = time.perf_counter()
            work()
            seconds = time.perf_counter() - t0
            if seconds >= 1.0:  # a profile, not a cache hit
                log.info("calibration of %s took %.1fs", name, seconds)
        bar.close()
        if self.budget is not None and self.card.charge_growth(self.budget):
            self.set_budget(self.budget.activation_bytes)
        if self.calibration is not None:
            log.info("calibration: %d profiled (%.1fs), %d read from %s", len(self.profiled),
                     self.calibration_seconds, self.calibration.hits, self.calibration.path)
        return [name for name, _ in pending]

    def _fit(self, request: Profile) -> CostModel:
        """The profile's cost model: the cache's fit under its key, else tuned, profiled (peaks
        measured under the tracker on the simulated device) and saved there."""
        name, cache = request.name, self.calibration
        self.profile_runs[name] = request.run
        key = calibration_key(request, self.model_keys, self.tracker is not None, self.device)
        self._keys[name] = key
        entry = cache.get(key) if (cache is not None and key is not None) else None
        if entry is not None and not self._retime(request, entry):
            cost = CostModel.from_dict(entry["cost"])
            if request.apply is not None:
                request.apply(dict(entry.get("settings", {})))
            log.info("cost model for %s read from the calibration cache: %s", name, cost.describe())
            return cost
        started = time.perf_counter()
        settings, timing = self._tune(request)
        if request.apply is not None:
            request.apply(dict(settings))
        shapes = request.grid(settings)
        began = time.time()
        cost = profile(request.run, lambda fn: self.measure(fn, f"profile:{name}"), shapes,
                       settings.get("chunk", request.chunk), request.chunk_rows, prefix_run=request.prefix_run,
                       lone_run=request.lone_run)
        self.profiled.append(name)
        seconds = time.perf_counter() - started
        self.calibration_seconds += seconds
        self._publish("profiled", ProfileRecord(name, owner_of(name), began, seconds, len(shapes)))
        if cache is not None and key is not None:
            cache.put(key, {"name": name, "cost": cost.to_dict(), "settings": settings, "timing": timing})
        return cost

    def remembered(self, name: str, what: str, measure: Callable[[], Any]) -> Any:
        """`measure()`, a JSON value `name`'s scorer measures at load after its fit (e.g. pass sizes
        timed), kept in the calibration cache under the fit's key: a later start reads it (measured
        again with `--recalibrate`, or when anything in the key changes)."""
        cache, key = self.calibration, self._keys.get(name)
        if cache is None or key is None:
            return measure()
        entry = cache.get(f"{key}:{what}")
        if entry is not None:
            return entry["value"]
        value = measure()
        cache.put(f"{key}:{what}", {"name": name, "value": value})
        return value

    def fits(self, name: str, batch: int, length: int) -> bool:
        """Whether one pass of `batch` x `length` lies inside `name`'s profiled shapes and is
        predicted to fit the budget free now."""
        cost = self.cost_model(name)
        return cost.admits(batch, length) and cost.predict(batch, length) <= plan_limit(self.free_bytes(), cost, self.margin)

    def _tune(self, request: Profile) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The profile's tuned settings and how quiet the machine was while they were timed (on
        CPU; None: nothing timed, or timed on a card, where the host's load is not what is timed).
        Timed busy, the profile's `planned` settings are kept (`calibration.CpuShare`)."""
        if request.tune is None:
            return {}, None
        # Timing passes, not a scoring pass: the budget does not bound them. Timed as the passes
        # will run: on the simulated device every aten op also pays the tracker's dispatch (~10 us),
        # which an untracked timing leaves out, so it would favour small chunks that cost many
        # more ops a step.
        with torch.inference_mode(), no_budget(self.tracker, enter=True), CpuShare() as meter:
            settings = request.tune()
        if self.device.type == "cuda":
            return settings, None
        if not meter.quiet:
            kept = f"{settings} kept" if request.planned is None else f"the plan's {request.planned} kept" + (
                f", not the measured {settings}" if settings != request.planned else "")
            log.warning("%s: timed on a busy machine (the timing thread ran %.0f%% of the time): %s; timed again "
                        "at a start that finds the machine quiet", request.name, 100 * meter.share, kept)
            settings = dict(request.planned) if request.planned is not None else settings
        return settings, meter.record()

    def _retime(self, request: Profile, entry: dict[str, Any]) -> bool:
        """Whether a cached entry's tuned settings are timed again: they were timed on a busy
        machine and this one is quiet now (`calibration.machine_quiet`)."""
        timing = entry.get("timing")
        if request.tune is None or not isinstance(timing, dict) or timing.get("quiet", True):
            return False
        if not machine_quiet():
            return False
        log.info("%s: its settings were timed on a busy machine (the timing thread ran %.0f%% of the time) "
                 "and this one is quiet: timing them again", request.name, 100 * float(timing.get("cpu_share", 0)))
        return True

    def measure(self, fn: Callable[[], Any], name: str = "measure") -> int:
        """Peak activation bytes of running `fn` in inference mode (tracker on CPU, allocator on CUDA)."""
        return measure_peak(fn, name, self.tracker, self.device)

    # -- running ----------------------------------------------------------------------------
    def run_pass(self, name: str, build: Callable[[Allowance], Pass], *, upper: int,
                 settings: Sequence[str] = ()) -> list[Outcome]:
        """A scorer's one call for a pass: what the budget allows (`Allowance`), the inputs the
        scorer builds within it (`build`, a `Pass`), planned and run under the guard (`run`).

        `upper`: the longest input the scorer has (already within its own bound). `settings`: the
        names of the scorer's other cost models, measured at load for other settings of its pass
        (DPO's smaller logits chunks), tried in order when `name`'s cannot hold `upper`: the first
        that can is used, else the one that holds the longest. Nothing is profiled here: a setting
        not measured at load is never tried, and what no measured one holds is cut by the scorer
        to `cap` (its `truncated` status says so).
        """
        allowance = Allowance(self.length_cap(name, upper), name)
        for setting in settings:
            if allowance.cap >= upper:
                break
            cap = self.length_cap(setting, upper)
            if cap > allowance.cap:
                allowance = Allowance(cap, setting)
        p = build(allowance)
        if not p.lengths:
            return []
        if allowance.cap < upper and max(p.lengths) >= allowance.cap:  # inputs cut to what was measured holds
            log.info("%s: inputs cut to %d tokens, what the measured cost models hold under the budget (longest %d)",
                     name, allowance.cap, upper)
        return self.run(name, p.lengths, p.forward, max_batch=p.max_batch, prepare=p.prepare, slack=p.slack,
                        prefix=p.prefix, completions=p.completions, cost_of=allowance.setting, rows=p.rows)

    def run(
        self,
        name: str,
        lengths: Sequence[int],
        forward: Forward,
        *,
        max_batch: int | None = None,
        prepare: Callable[[], Any] | None = None,
        slack: float | None = None,
        prefix: int = 0,
        completions: Sequence[int | None] | None = None,
        cost_of: str | None = None,
        rows: Callable[[int, int], int] | None = None,
    ) -> list[Outcome]:
        """Plan batches for `lengths`, run `forward(indices)` on each under the guard.

        `forward` returns one value per index it was given, with inputs moved to the model's
        current device. `prepare()` runs first, on the device, and what it keeps (a shared
        prefix's keys and values) is live when the batches are planned, so it is not counted as
        free. When even a batch of one runs out of memory, a model allowed on the CPU (`cpu_ok`: the
        filters) gets a CPU fallback: its weights move to the host for that input and back, and the
        cost (bytes moved, seconds) is logged; any other model's input gets the `oom` status. A
        model that placement put on the CPU runs in host memory, outside the device budget.
        `slack`: batches also close where their padding would pass that share (`plan_batches`): a
        scorer that runs each batch in `padding_groups` passes `PADDING_SLACK`, so the rectangle
        planned and predicted is the one that runs. `prefix`: that many tokens of every input
        are a shared prefix `prepare` runs once (`CostModel.predict(prefix=)`). `completions`:
        the step's completion index of each input (None: the prompt), for the observers' records,
        which would otherwise know only the scorer's own numbering (DPO skips empty completions,
        the classifiers merge identical texts and cut long ones into windows). `cost_of`: the
        cost model to plan with when not `name`'s (one of the scorer's settings, `run_pass`). `rows`:
        the rows a batch really runs as, filler rows included (`Pass.rows`).
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
            self._prefetch_expected(owner)
            cost = self.cost_model(cost_of or name)
            if prepare is not None:
                prepare_batches(name, prepare, device=self.device, on_host=on_host, tracker=self.tracker)
            budget = float("inf") if on_host else self.free_bytes()
            batches = plan_batches(lengths, cost, budget, margin=self.margin, max_batch=max_batch, largest_first=True,
                                   slack=slack, prefix=prefix, rows=rows)
            for o in list(self.observers):  # e.g. one telemetry record per batch the guard runs (the fallback's too)
                forward = o.batch(name, lengths, forward, cost, on_host, prefix=prefix, completions=completions)
            cpu_ok = self._registered.get(owner, ((), False))[1]
            fallback = cpu_fallback(owner, forward, self.placement) if not on_host and cpu_ok else None
            # In host memory: no device budget, no injected device OOMs, no fallback, no trust regained.
            device, injector = (torch.device("cpu"), None) if on_host else (self.device, self.injector)
            with torch.inference_mode(), where_run(on_host, self.tracker):
                results = run_guarded(name, batches, lengths, forward, device=device, fallback=fallback,
                                      injector=injector, on_oom=lambda rec: self._record_oom(rec, cost),
                                      on_ok=None if on_host else lambda batch: cost.record_clean())
            return [results[i] for i in range(len(lengths))]

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Inside: a request is being scored (the stack opens it around a step's forward passes), so
        `calibrate` refuses: what a pass meets that was not measured is planned within what was
        (the planner admits no shape past the profiled ones; DPO keeps its measured chunks)."""
        saved, self._serving = self._serving, True
        try:
            yield
        finally:
            self._serving = saved

    def _bring_in(self, owner: str) -> bool:
        """Put `owner` where it runs, if placement manages it; True when it runs on the host (placed on
        the CPU)."""
        if self.placement is None or owner not in self.placement.names():
            return False
        self.placement.ensure(owner)
        return self.device_for(owner) != self.device or self.placement.decisions[owner].where == "cpu"

    def _record_oom(self, rec: OomRecord, cost: CostModel) -> None:
        """Keep and publish an OOM the guard handled; a real one (not injected) lowers `cost`'s trust,
        which batches that run clean bring back (`CostModel.record_clean`)."""
        self.oom_log.append(rec)
        self.ooms_total += 1
        self._publish("oom", rec)
        if not rec.injected:
            cost.distrust()
        log.warning("OOM in %s: batch %d x %d (lengths %s) -> %s: %s",
                    rec.model, rec.batch, rec.length, rec.lengths[:8], rec.action, rec.message)

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

