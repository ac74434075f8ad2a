"""Calibration: the memory manager's load-time profiles that fit each model's cost model.

A mixin of `MemoryManager` (`rewardstack.memory.manager`): `calibrate` queues or runs a model's
profile (or reads it from the calibration cache), `run_calibrations` runs the queue where each
model will run, `measure` gives the peak of one call.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack.memory.calibration import calibration_key, environment
from rewardstack.memory.costmodel import CostModel, ProfileCapped, profile, profile_shapes
from rewardstack.memory.observers import ProfileRecord
from rewardstack.memory.peaks import PeakWindow
from rewardstack.memory.tracker import TensorBytesTracker
from rewardstack.models import owner_of

log = logging.getLogger("rewardstack.memory")


class Calibrating:
    """`MemoryManager`'s calibration (state lives on the manager)."""

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
        limit_s: float | None = None,
        prefix_run: Callable[[int, int, int], Any] | None = None,
        lone_run: Callable[[int], Any] | None = None,
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
        `limit_s` caps the profile's time (a profile asked for mid-run, inside a step): past it
        `costmodel.ProfileCapped` is raised, nothing is fitted or cached, and the caller keeps a
        setting it has a cost model for. Every profile that runs is told to the observers
        (`ProfileRecord`: the telemetry's `profiling` records).
        `prefix_run(B, L, P)`: the pass after a shared prefix of P tokens (a causal scorer's
        `PrefixRunner`); profiled too, it lets `run(prefix=)` predict such passes below the bound.
        `lone_run(L)`: one unpadded input (an encoder drops the mask then); fits batches of one.

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
        if tune is not None and self.tracker is not None:  # timed under the tracker (see below)
            args["tuned_tracked"] = True
        if prefix_run is not None:  # only then: the other scorers' cached fits keep their keys
            args["prefixed"] = True
        if lone_run is not None:
            args["lone"] = True

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
                    # Timed as the passes will run: on the simulated device every aten op also pays
                    # the tracker's dispatch (~10 us), which an untracked timing leaves out; DPO's
                    # tiny soak stack then picked 32-row chunks and spent 12,700 ops a step on them.
                    with torch.inference_mode(), _tracked_no_budget(self.tracker):
                        settings = tune()
                if apply is not None:
                    apply(dict(settings))
                use_chunk = settings.get("chunk", chunk)
                if grid_of is not None:
                    shapes_ = list(grid_of(settings))
                else:
                    shapes_ = grid if grid is not None else profile_shapes(max_length, max_batch, use_chunk, max_tokens)
                began = time.time()
                try:
                    cost = profile(run, lambda fn: self.measure(fn, f"profile:{name}"), shapes_, use_chunk, chunk_rows,
                                   limit_s=limit_s, prefix_run=prefix_run, lone_run=lone_run)
                except ProfileCapped as e:
                    self.calibration_seconds += time.perf_counter() - started
                    self._publish_profile(ProfileRecord(name, owner_of(name), began, time.perf_counter() - started,
                                                        len(shapes_), e.measured, True, limit_s))
                    raise
                self.profiled.append(name)
                self.calibration_seconds += time.perf_counter() - started
                self._publish_profile(ProfileRecord(name, owner_of(name), began, time.perf_counter() - started,
                                                    len(shapes_), len(shapes_), False, limit_s))
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
        owner = owner_of(name)
        if self.placement is not None and owner in self.placement.names():
            self.placement.ensure(owner)  # a profile after start-up (DPO's smaller chunk) runs where scoring does
        return work()

    def _publish_profile(self, record: ProfileRecord) -> None:
        for o in list(self.observers):
            o.profiled(record)

    def _calibration_key(self, name: str, args: dict[str, Any]) -> str | None:
        owner = owner_of(name)
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
        from tqdm import tqdm  # per-model progress on a terminal (off when stderr is not one)

        bar = tqdm(pending, desc="calibrating", unit="model", file=sys.stderr, disable=None, leave=False)
        for name, work in bar:
            bar.set_postfix_str(name)
            owner = owner_of(name)
            if self.placement is not None and owner in self.placement.names():
                self.placement.ensure(owner)
            t0 = time.perf_counter()
            work()
            seconds = time.perf_counter() - t0
            if seconds >= 1.0:  # a profile, not a cache hit
                log.info("calibration of %s took %.1fs", name, seconds)
            done.append(name)
        bar.close()
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
