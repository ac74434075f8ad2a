"""Calibration: the load-time profiles that fit each model's cost model, or the cache's saved fit.

`Profile` is what a scorer hands the memory layer, its whole side of calibration (what to run at a
shape, which shapes it admits, what it tunes first); `Calibrator` owns what calibration remembers
(each model's key, the queue kept while the models load on the host, the names profiled and the
seconds spent, the run each fit was measured with) and fits a profile; `measure_peak` is the peak
of one call.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack._memory.calibration import CalibrationCache, calibration_key, environment
from rewardstack._memory.costmodel import CostModel, ProfileCapped, profile, profile_shapes
from rewardstack._memory.observers import ProfileRecord
from rewardstack._memory.peaks import PeakWindow
from rewardstack._memory.tracker import TensorBytesTracker
from rewardstack._models import owner_of

log = logging.getLogger("rewardstack.memory")

Shapes = Sequence[tuple[int, int]] | Callable[[dict[str, Any]], Sequence[tuple[int, int]]] | None


@dataclass
class Profile:
    """A scorer's profile, the one thing it hands `MemoryManager.calibrate`: what to run at a shape
    and which shapes it admits, plus what it measures before profiling.

    `run(B, L)`: one forward pass on a B x L dummy batch, on the scorer's own path (its prefix
    cache, its penalty): the fit is only as good as the passes it measured. `max_length`: the
    longest input the scorer admits (the planner admits nothing past the largest profiled shape).
    `max_tokens` drops shapes wider than that (B*L) from the default grid (and caps batches there).
    `chunk`: the scorer computes logits in chunks of this many positions (adds that term);
    `chunk_rows`: the chunks run over the rows of the whole batch, not of each sequence.
    `tune()`: settings measured before profiling (e.g. DPO's logits chunk, {"chunk": 128});
    `apply(settings)` hands them, or the cached ones, back to the scorer.
    `shapes` may be a function of those settings (a tuned pass size decides how wide the profiled
    batches must reach); its qualified name then stands for it in the cache key.
    `limit_s` caps the profile's time (a profile asked for mid-run, inside a step): past it
    `costmodel.ProfileCapped` is raised, nothing is fitted or cached, and the caller keeps a
    setting it has a cost model for.
    `prefix_run(B, L, P)`: the pass after a shared prefix of P tokens (a causal scorer's
    `PrefixRunner`); profiled too, it lets `run(prefix=)` predict such passes below the bound.
    `lone_run(L)`: one unpadded input (an encoder drops the mask then); fits batches of one.
    """

    name: str
    run: Callable[[int, int], Any]
    max_length: int
    max_batch: int = 8
    shapes: Shapes = None
    chunk: int | None = None
    chunk_rows: bool = False
    max_tokens: int | None = None
    tune: Callable[[], dict[str, Any]] | None = None
    apply: Callable[[dict[str, Any]], None] | None = None
    limit_s: float | None = None
    prefix_run: Callable[[int, int, int], Any] | None = None
    lone_run: Callable[[int], Any] | None = None

    def __post_init__(self) -> None:
        if self.shapes is None and self.max_tokens is None:
            self.max_tokens = int(self.max_length)  # batches up to one longest input's tokens (TEI-like)

    def key_args(self, tracked: bool) -> dict[str, Any]:
        """What the calibration key records of the profile (with the model's key and the
        environment). `tracked`: `tune` is timed under the simulated device's tracker."""
        grid_of = self.shapes if callable(self.shapes) else None
        grid = list(self.shapes) if self.shapes is not None and grid_of is None else None  # type: ignore[arg-type]
        args = {"max_length": int(self.max_length), "max_batch": int(self.max_batch),
                "shapes": grid_of.__qualname__ if grid_of is not None else grid, "chunk": self.chunk,
                "chunk_rows": self.chunk_rows, "max_tokens": self.max_tokens, "tuned": self.tune is not None}
        if tracked and self.tune is not None:  # timed under the tracker (see `Calibrator.fit`)
            args["tuned_tracked"] = True
        if self.prefix_run is not None:  # only then: the other scorers' cached fits keep their keys
            args["prefixed"] = True
        if self.lone_run is not None:
            args["lone"] = True
        return args

    def grid(self, settings: dict[str, Any]) -> list[tuple[int, int]]:
        """The shapes to profile once `settings` (what `tune` measured) are known."""
        if callable(self.shapes):
            return list(self.shapes(settings))
        if self.shapes is not None:
            return list(self.shapes)
        return profile_shapes(self.max_length, self.max_batch, settings.get("chunk", self.chunk), self.max_tokens)


class Calibrator:
    """Fits cost models for the manager and remembers what calibration did.

    `device`: where the profiles run (part of every key's environment); `publish`: told of every
    profile that runs (`ProfileRecord`, the telemetry's `profiling` records).
    """

    def __init__(self, device: torch.device, publish: Callable[[ProfileRecord], None]) -> None:
        self.device = device
        self.publish = publish
        self.model_keys: dict[str, dict[str, Any]] = {}  # scorer name -> what its fit depends on
        self.profiled: list[str] = []  # names whose cost model was measured in this process
        self.seconds = 0.0  # spent tuning and profiling (a cache read costs none)
        self.profile_runs: dict[str, Callable[[int, int], Any]] = {}  # the run each fit measured
        self._pending: list[tuple[str, Callable[[], CostModel]]] | None = None

    def describe_model(self, model_cfg: Any, cache: CalibrationCache | None) -> None:
        """Record what a scorer's fits depend on, the model part of its calibration key: its
        checkpoints by content (`calibration.checkpoint_identity`, not where they sit, so another
        config or folder with the same checkpoint shares the fit) and its settings."""
        from dataclasses import asdict

        from rewardstack._memory.calibration import checkpoint_identity

        d = {k: v for k, v in asdict(model_cfg).items() if k not in ("weight", "enabled", "path", "paths")}
        if cache is not None:  # hashing the checkpoint serves the cache only
            d["checkpoints"] = [checkpoint_identity(p, cache) for p in [model_cfg.path, *model_cfg.paths] if p]
            cache.save()  # digests of new files: not read again at the next start
        self.model_keys[model_cfg.name] = d

    def key(self, request: Profile, tracked: bool) -> str | None:
        """The profile's calibration key (None: its model was never described, so nothing is cached)."""
        model = self.model_keys.get(request.name, self.model_keys.get(owner_of(request.name)))
        if model is None:
            return None
        return calibration_key({"scorer": request.name, **model}, request.key_args(tracked), environment(self.device))

    def fit(self, request: Profile, cache: CalibrationCache | None, tracker: TensorBytesTracker | None) -> CostModel:
        """The profile's cost model: the cache's fit under its key, else tuned, profiled (peaks
        measured under `tracker` on the simulated device) and saved there.

        `costmodel.ProfileCapped` (past `limit_s`) propagates with nothing fitted or cached.
        """
        name = request.name
        key = self.key(request, tracked=tracker is not None)
        entry = cache.get(key) if (cache is not None and key is not None) else None
        if entry is not None:
            cost = CostModel.from_dict(entry["cost"])
            if request.apply is not None:
                request.apply(dict(entry.get("settings", {})))
            log.info("cost model for %s read from the calibration cache: %s", name, cost.describe())
            self.profile_runs[name] = request.run
            return cost
        started = time.perf_counter()
        settings: dict[str, Any] = {}
        if request.tune is not None:  # timing passes, not a scoring pass: the budget does not bound them
            # Timed as the passes will run: on the simulated device every aten op also pays the
            # tracker's dispatch (~10 us), which an untracked timing leaves out; DPO's tiny soak
            # stack then picked 32-row chunks and spent 12,700 ops a step on them.
            with torch.inference_mode(), _tracked_no_budget(tracker):
                settings = request.tune()
        if request.apply is not None:
            request.apply(dict(settings))
        use_chunk = settings.get("chunk", request.chunk)
        shapes = request.grid(settings)
        began = time.time()
        try:
            cost = profile(request.run, lambda fn: measure_peak(fn, f"profile:{name}", tracker, self.device), shapes,
                           use_chunk, request.chunk_rows, limit_s=request.limit_s, prefix_run=request.prefix_run,
                           lone_run=request.lone_run)
        except ProfileCapped as e:
            self.seconds += time.perf_counter() - started
            self.publish(ProfileRecord(name, owner_of(name), began, time.perf_counter() - started,
                                       len(shapes), e.measured, True, request.limit_s))
            raise
        self.profiled.append(name)
        self.seconds += time.perf_counter() - started
        self.publish(ProfileRecord(name, owner_of(name), began, time.perf_counter() - started,
                                   len(shapes), len(shapes), False, request.limit_s))
        if cache is not None and key is not None:
            cache.put(key, {"name": name, "cost": cost.to_dict(), "settings": settings})
        self.profile_runs[name] = request.run
        return cost

    # -- the queue kept while models load on the host -----------------------------------------
    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Queue the work `queue` is given inside (see `MemoryManager.deferred_calibration`)."""
        self._pending = []
        try:
            yield
        except BaseException:
            self._pending = None
            raise

    def queue(self, name: str, work: Callable[[], CostModel]) -> bool:
        """Queue `work` when inside `deferred()` (True); False: the caller runs it now."""
        if self._pending is None:
            return False
        self._pending.append((name, work))
        return True

    def run_queue(self, before: Callable[[str], None]) -> list[str]:
        """Run the queued work in order, `before(name)` first for each; the names run."""
        pending, self._pending = self._pending or [], None
        done = []
        from tqdm import tqdm  # per-model progress on a terminal (off when stderr is not one)

        bar = tqdm(pending, desc="calibrating", unit="model", file=sys.stderr, disable=None, leave=False)
        for name, work in bar:
            bar.set_postfix_str(name)
            before(name)
            t0 = time.perf_counter()
            work()
            seconds = time.perf_counter() - t0
            if seconds >= 1.0:  # a profile, not a cache hit
                log.info("calibration of %s took %.1fs", name, seconds)
            done.append(name)
        bar.close()
        return done


def measure_peak(fn: Callable[[], Any], name: str, tracker: TensorBytesTracker | None, device: torch.device) -> int:
    """Peak activation bytes of running `fn` in inference mode: the tracker's count on the simulated
    device (its budget lifted: profile runs may pass it), the allocator's on CUDA."""
    with torch.inference_mode():  # what `MemoryManager.run` does: no autograd graph is kept
        if tracker is not None:
            with tracker.window(name) as w, _no_budget(tracker):
                fn()
            return w.peak_increase
        return _cuda_peak(fn, device)  # pragma: no cover - CUDA-only path


@contextmanager
def _no_budget(tracker: TensorBytesTracker) -> Iterator[None]:
    """Lift the tracker's budget inside (profile runs); keep counting."""
    saved = tracker.budget_bytes
    tracker.budget_bytes = None
    try:
        yield
    finally:
        tracker.budget_bytes = saved


@contextmanager
def _tracked_no_budget(tracker: TensorBytesTracker | None) -> Iterator[None]:
    """Count ops under the tracker with its budget lifted (nothing on CUDA, where there is none)."""
    if tracker is None:
        yield
        return
    with tracker, _no_budget(tracker):
        yield


def _cuda_peak(fn: Callable[[], Any], device: torch.device) -> int:  # pragma: no cover - CUDA-only path
    torch.cuda.synchronize(device)
    with PeakWindow(device, None) as w:  # nestable: an open telemetry or replay window keeps its peak
        fn()
        torch.cuda.synchronize(device)
    return int(w.peak_increase or 0)
