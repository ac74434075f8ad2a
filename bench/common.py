"""Helpers every benchmark shares: wall time of a call, its peak of live tensor bytes, and a
`REWARDSTACK_HOME` of the run's own."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

from rewardstack._memory import MemoryManager, TensorBytesTracker
from bench.realmodels import CACHE_ENV as REAL_CACHE_ENV, default_cache

MiB = 2**20


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn()` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def peak_of(fn: Callable[[], Any]) -> int:
    """Peak live tensor bytes while `fn` runs (the simulated device's count, no budget)."""
    tracker = TensorBytesTracker(None)
    with torch.inference_mode(), tracker.window("peak") as w:
        fn()
    return w.peak_increase


@contextmanager
def own_home(home: Path) -> Iterator[None]:
    """Run the body with `REWARDSTACK_HOME` set to `home` (the environment restored after): speed
    settings and cost models are timed on this machine now, not read from a calibration cache
    another run tuned, perhaps on a busier machine. The real checkpoints stay where they were
    fetched."""
    with mock.patch.dict(os.environ):
        os.environ.setdefault(REAL_CACHE_ENV, str(default_cache()))
        os.environ["REWARDSTACK_HOME"] = str(home)
        yield


def check_cost_model(mm: MemoryManager, name: str, shapes: list[tuple[int, int]]) -> list[tuple[int, int, float, int]]:
    """(B, L, predicted, measured) at `shapes` off the profiled grid, measured with the profile run the
    manager's calibration of `name` used (`MemoryManager.profile_runs`)."""
    run, cost = mm.profile_runs[name], mm.cost_models[name]
    return [(b, l, cost.predict(b, l), mm.measure(lambda b=b, l=l: run(b, l), f"check:{name}")) for b, l in shapes]
