"""Helpers every benchmark shares: wall time of a call and its peak of live tensor bytes."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from rewardstack._memory import TensorBytesTracker

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
