"""Counts live tensor bytes on CPU (or any device) with a PyTorch dispatch mode.

This is the simulated device: every tensor an aten op creates while the tracker is active is
charged to it until its storage is freed, the peak is recorded per window, and an allocation that
would push live bytes past `budget_bytes` raises the same `torch.OutOfMemoryError` that a CUDA
allocation raises. Weights created before the tracker is entered are not charged, so the budget is
the activation budget, as on a GPU where weights are already resident.

Limits, on purpose: memory a kernel allocates internally and frees before returning (e.g. a fused
attention's workspace) is invisible, as are tensors created outside any aten op (e.g. by numpy).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def simulated_oom(requested: int, live: int, budget: int) -> torch.OutOfMemoryError:
    """An OutOfMemoryError worded like CUDA's, for a simulated allocation that does not fit."""
    gib = 1024**3
    return torch.OutOfMemoryError(
        f"Simulated device out of memory. Tried to allocate {requested / gib:.2f} GiB "
        f"({live / gib:.2f} GiB already allocated; budget {budget / gib:.2f} GiB)"
    )


@dataclass
class Window:
    """Peak and live bytes seen inside one named `TensorBytesTracker.window`."""

    name: str
    start_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0

    @property
    def peak_increase(self) -> int:
        """Peak bytes above what was live when the window opened."""
        return self.peak_bytes - self.start_bytes


class TensorBytesTracker(TorchDispatchMode):
    """A dispatch mode that counts live tensor bytes and enforces an optional budget.

    Use as a context manager (`with tracker:`); it is re-entrant across `window()` calls.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.oom_count = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self._lock = threading.Lock()

    # -- accounting -------------------------------------------------------------------------
    def _on_free(self, key: int, nbytes: int, _ref: Any = None) -> None:
        with self._lock:
            if self._refs.pop(key, None) is not None:
                self.live_bytes -= nbytes

    def _charge(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        nbytes = st.nbytes()
        key = st.data_ptr()
        if nbytes == 0 or key in self._refs:
            return
        with self._lock:
            if self.budget_bytes is not None and self.live_bytes + nbytes > self.budget_bytes:
                self.oom_count += 1
                raise simulated_oom(nbytes, self.live_bytes, self.budget_bytes)
            ref = weakref.ref(st, lambda r, k=key, n=nbytes: self._on_free(k, n))
            self._refs[key] = (ref, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        try:
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._charge(t)
        except torch.OutOfMemoryError:
            # Drop the outputs before raising, as a failed allocation would never have made them.
            del out, flat
            raise
        return out

    # -- windows ----------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak_bytes = self.live_bytes

    @contextmanager
    def window(self, name: str = "window") -> Iterator[Window]:
        """Reset the peak, run the body with tracking on, and fill in the window's peak."""
        w = Window(name=name, start_bytes=self.live_bytes)
        outer_peak = self.peak_bytes
        self.reset_peak()
        entered = False
        if not _mode_active(self):
            self.__enter__()
            entered = True
        try:
            yield w
        finally:
            if entered:
                self.__exit__(None, None, None)
            w.peak_bytes = self.peak_bytes
            w.end_bytes = self.live_bytes
            self.peak_bytes = max(outer_peak, self.peak_bytes)


def _mode_active(mode: TorchDispatchMode) -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(m is mode for m in _get_current_dispatch_mode_stack())
