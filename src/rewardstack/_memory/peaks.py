"""Peak windows: the memory peak of one stretch of work above what was live when it opened, nestable.

A window may open inside another (the step's window around each model call's; replay's window
around a model's run), and an inner window never resets an outer one's peak.

- CPU (the simulated device): a window of the tensor-bytes tracker, which keeps one peak per open
  window already (`TensorBytesTracker.window`).
- CUDA: the caching allocator has one peak counter per device, and measuring a window's own peak
  needs it reset when the window opens. Every reset goes through one `PeakLedger` per process,
  which first folds the counter into every window open on that device, so a reset can never lose
  an outer window's peak: an outer window reports the largest of what it saw itself and of every
  inner window. (A single reset per process cannot measure an inner window whose peak is below an
  earlier, higher one: the counter only rises. Folding before each reset is the equivalent that can.)

The allocator's counters are read through an `AllocatorStats` provider, injectable
(`use_allocator_stats`), so the CUDA path is testable on a machine without a GPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from rewardstack._memory.tracker import TensorBytesTracker


class AllocatorStats(Protocol):
    """The three counters of a device allocator a peak window needs."""

    def allocated(self, device: torch.device) -> int:
        """Bytes held by live tensors now."""

    def peak(self, device: torch.device) -> int:
        """Highest allocated bytes since the peak was last reset."""

    def reset_peak(self, device: torch.device) -> None:
        """Start the peak again from what is allocated now."""


class CudaAllocatorStats:
    """`AllocatorStats` of PyTorch's CUDA caching allocator."""

    def allocated(self, device: torch.device) -> int:  # pragma: no cover - CUDA-only path
        return int(torch.cuda.memory_allocated(device))

    def peak(self, device: torch.device) -> int:  # pragma: no cover - CUDA-only path
        return int(torch.cuda.max_memory_allocated(device))

    def reset_peak(self, device: torch.device) -> None:  # pragma: no cover - CUDA-only path
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class _Open:
    device: str
    start: int
    peak: int


class PeakLedger:
    """Owns the allocator's peak counter: the windows open on each device and the only resets."""

    def __init__(self, stats: AllocatorStats) -> None:
        self.stats = stats
        self._lock = threading.Lock()
        self._open: dict[str, list[_Open]] = {}

    def _fold(self, device: torch.device) -> None:
        windows = self._open.get(str(device))
        if windows:
            peak = self.stats.peak(device)
            for w in windows:
                w.peak = max(w.peak, peak)

    def open(self, device: torch.device) -> _Open:
        """Open a window on `device`: fold the counter into the open ones, then reset it."""
        with self._lock:
            self._fold(device)
            self.stats.reset_peak(device)
            start = self.stats.allocated(device)
            w = _Open(str(device), start, start)
            self._open.setdefault(str(device), []).append(w)
            return w

    def close(self, device: torch.device, w: _Open) -> int:
        """Close a window; its peak (absolute bytes). The outer windows keep theirs."""
        with self._lock:
            self._fold(device)
            windows = self._open.get(str(device), [])
            windows[:] = [o for o in windows if o is not w]
            return w.peak


_ledger = PeakLedger(CudaAllocatorStats())


def ledger() -> PeakLedger:
    """The process's peak ledger (every CUDA peak window and measurement goes through it)."""
    return _ledger


@contextmanager
def use_allocator_stats(stats: AllocatorStats) -> Iterator[PeakLedger]:
    """Read the allocator through `stats` inside (tests: a fake allocator on a machine without CUDA)."""
    global _ledger
    saved = _ledger
    _ledger = PeakLedger(stats)
    try:
        yield _ledger
    finally:
        _ledger = saved


class PeakWindow:
    """Peak bytes of a stretch of work above what was live when it opened (nestable, see the module).

    CPU: a window of the tracker, when the tracker counts the current thread (a model run in host
    memory has no device peak: None; with `watch=True`, a step's window, the peak of the calls inside
    that count). CUDA: a window of the process's `PeakLedger`. Use as a context
    manager; read `start`, `peak` and `peak_increase` after.
    """

    def __init__(self, device: torch.device | str, tracker: TensorBytesTracker | None, *, watch: bool = False) -> None:
        self.device = torch.device(device)
        self.tracker = tracker
        self.watch = watch  # a stretch of several calls (a step): watch the tracker without entering it
        self.start: int | None = None
        self.peak: int | None = None
        self._cm: Any = None
        self._window: Any = None
        self._ledger: PeakLedger | None = None
        self._open: _Open | None = None

    @property
    def peak_increase(self) -> int | None:
        """Peak bytes above the start (None when nothing was measured)."""
        if self.start is None or self.peak is None:
            return None
        return self.peak - self.start

    def __enter__(self) -> "PeakWindow":
        if self.tracker is not None:
            if self.tracker.is_active():  # never start counting a thread that runs in host memory
                self._cm = self.tracker.window("call")
                self._window = self._cm.__enter__()
                self.start = self._window.start_bytes
            elif self.watch:  # the calls inside enter the tracker themselves
                self._cm = self.tracker.watch("step")
                self._window = self._cm.__enter__()
                self.start = self._window.start_bytes
        elif self.device.type == "cuda":
            self._ledger = ledger()
            self._open = self._ledger.open(self.device)
            self.start = self._open.start
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)
            self.peak = self._window.peak_bytes
        elif self._ledger is not None and self._open is not None:
            self.peak = self._ledger.close(self.device, self._open)
