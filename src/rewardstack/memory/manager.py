"""The memory manager: the one object scorers ask to run their forward passes.

Split along its seams: sizing the card and the budget (`sizing.CardSizing`: `setup`,
`live_bytes`), calibration (`calibrating.Calibrating`: `calibrate`, `run_calibrations`,
`measure`) and the guarded run (`guarded.GuardedRun`: `run`); this module holds the state they
share, registration, placement, cost models and the observers.

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
from typing import Any, Callable

import torch

from rewardstack.memory.budget import Budget, DeviceSnapshot
from rewardstack.memory.calibrating import Calibrating
from rewardstack.memory.calibration import CalibrationCache
from rewardstack.memory.costmodel import CostModel
from rewardstack.memory.guard import FaultInjector, OomRecord
from rewardstack.memory.guarded import GuardedRun
from rewardstack.memory.observers import MemoryObserver, PlacementMove
from rewardstack.memory.placement import Decision, Placement
from rewardstack.memory.planner import max_fitting_length
from rewardstack.memory.sizing import CardSizing
from rewardstack.memory.tracker import TensorBytesTracker

log = logging.getLogger("rewardstack.memory")

# OOM records kept in memory (a ring buffer); totals are counted without limit.
OOM_LOG_SIZE = 256


class MemoryManager(CardSizing, Calibrating, GuardedRun):
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
        self.up_next: str | None = None
        """The model the stack runs after the current one: prefetched once the current one is placed."""
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
        """The manager a stack built from `cfg` uses: its device and margin, and the config's
        calibration cache (`[memory] calibration_file`, else in the config's home folder,
        `rewardstack.paths.calibration_file`; none for a config built in code)."""
        from rewardstack.memory.calibration import cache_path_for

        memory = getattr(cfg, "memory", None)
        path = cache_path_for(getattr(cfg, "source", None), getattr(memory, "calibration_file", None))
        cache = CalibrationCache(path, recalibrate=recalibrate) if path is not None or recalibrate else None
        return cls(None, device=torch.device(cfg.device), margin=cfg.safety_margin, calibration=cache,
                   profile_limit_s=getattr(memory, "profile_seconds", None))

    def describe_model(self, model_cfg: Any) -> None:
        """Record what a scorer's fits depend on, the model part of its calibration key: its
        checkpoints by content (`calibration.checkpoint_identity`, not where they sit, so another
        config or folder with the same checkpoint shares the fit) and its settings."""
        from dataclasses import asdict

        from rewardstack.memory.calibration import checkpoint_identity

        d = {k: v for k, v in asdict(model_cfg).items() if k not in ("weight", "enabled", "path", "paths")}
        if self.calibration is not None:  # hashing the checkpoint serves the cache only
            d["checkpoints"] = [checkpoint_identity(p, self.calibration) for p in [model_cfg.path, *model_cfg.paths] if p]
            self.calibration.save()  # digests of new files: not read again at the next start
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

