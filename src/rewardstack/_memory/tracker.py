"""Counts live tensor bytes on CPU (or any device) with a PyTorch dispatch mode.

This is the simulated device: every storage an aten op *creates* while the tracker is active is
charged to it until that storage is freed, the peak is recorded per window, and an allocation that
would push live bytes past `budget_bytes` raises the same `torch.OutOfMemoryError` that a CUDA
allocation raises. Weights created before the tracker is entered are not charged, so the budget is
the activation budget, as on a GPU where weights are already resident.

Accounting is by storage, not by tensor: a view, an in-place op or an `out=` op returns a tensor
whose storage is one of its inputs', and is never charged again (a view of a weight, like the
`weight.t()` inside `linear`, costs nothing). A storage that grows in place (`resize_`) is charged
the difference. Frees are seen through a weakref callback on the storage's Python object, which
PyTorch keeps alive exactly as long as the storage itself.

Threads: PyTorch's dispatch-mode stack is thread-local, so each thread that should be counted must
enter the tracker itself (`with tracker:`, re-entrant per thread); the counters are shared and
locked, so one tracker sums the bytes of every thread that entered it.

Meta tensors are counted too (a meta storage has a size but no data): a model built on the meta
device runs its forward passes under the tracker with no weights and no arithmetic, which is how
`rewardstack._planning.simulate` measures full-size models on a laptop.

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
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack


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


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in an aten op's arguments or result (tensors, lists/tuples of them, kwargs dicts).

    Called on every op the tracker sees, so it is a plain walk rather than `torch.utils._pytree`'s
    `tree_flatten`, which builds a tree spec nobody reads and cost about a fifth of a tiny-stack
    soak step. Aten schemas only nest tensors in lists, tuples and the kwargs dict."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return out


def storage_of(t: torch.Tensor) -> Any | None:
    """The untyped storage of a plain tensor (None for sparse or storage-less tensors).

    Meta tensors count like any other: their storages have a size and no data, so a forward pass
    on the meta device is charged exactly the bytes it would allocate (`planning.simulate`)."""
    if t.is_sparse:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class TensorBytesTracker(TorchDispatchMode):
    """A dispatch mode that counts live tensor bytes and enforces an optional budget.

    Use as a context manager (`with tracker:`); entering it again in a thread where it is already
    active is a no-op, so nested `with tracker:` / `window()` calls are safe.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.oom_count = 0
        self.charged_total = 0  # bytes ever charged (a cheap activity counter for logs)
        # id(storage object) -> (weakref to it, bytes charged). PyTorch keeps one Python object per
        # live storage, so the id is stable while the storage lives and survives reallocation.
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self._ops: dict[int, Any] = {}  # id(storage) -> the aten op that made it (OOM forensics)
        self.last_oom: dict[str, Any] | None = None  # see `_oom_report`
        self._lock = threading.RLock()
        self._open: list[Window] = []  # every window open now, in any thread
        self._tls = threading.local()

    # -- entering (re-entrant per thread) -----------------------------------------------------
    def __enter__(self) -> "TensorBytesTracker":
        depth = getattr(self._tls, "depth", 0)
        # Pushing the same mode twice would run every op through it twice; count instead.
        if depth == 0 and not any(m is self for m in _get_current_dispatch_mode_stack()):
            super().__enter__()
            self._tls.pushed = True
        elif depth == 0:
            self._tls.pushed = False
        self._tls.depth = depth + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tls.depth -= 1
        if self._tls.depth == 0 and self._tls.pushed:
            super().__exit__(*exc)

    def is_active(self) -> bool:
        """Whether the tracker counts ops run by the current thread."""
        return getattr(self._tls, "depth", 0) > 0 or any(
            m is self for m in _get_current_dispatch_mode_stack()
        )

    # -- accounting -------------------------------------------------------------------------
    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._refs.get(key)
            # Only the callback of the storage that was charged may uncharge it: a new storage
            # object can reuse a freed id before a late callback runs.
            if entry is not None and entry[0] is ref:
                del self._refs[key]
                self._ops.pop(key, None)
                self.live_bytes -= entry[1]

    def _bump_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        for w in self._open:
            if self.live_bytes > w.peak_bytes:
                w.peak_bytes = self.live_bytes

    def _charge_outputs(self, outputs: list[torch.Tensor], inputs: Any, op: Any = None) -> None:
        """Charge the storages the op created; raise a simulated OOM if they do not fit.

        `inputs` (the op's args and kwargs) are only walked when an output's storage is not
        charged already: most ops return fresh storages or views of tracked ones, and the walk
        was a fifth of the tracker's cost per op."""
        input_keys: set[int] | None = None
        new: dict[int, tuple[Any, int]] = {}
        grow: dict[int, int] = {}
        for t in outputs:
            st = storage_of(t)
            if st is None:
                continue
            nbytes = int(st.nbytes())
            key = id(st)
            if nbytes == 0:
                continue
            entry = self._refs.get(key)
            if entry is not None:
                if entry[0]() is st and nbytes > entry[1]:  # grown in place (resize_, out=)
                    grow[key] = nbytes
                continue
            if input_keys is None:
                input_keys = {id(s) for s in map(storage_of, tensors_in(inputs)) if s is not None}
            if key in input_keys:  # a view of / in place on a storage made outside the tracker
                continue
            new[key] = (st, nbytes)
        if not new and not grow:
            return
        with self._lock:
            extra = sum(n for _, n in new.values()) + sum(n - self._refs[k][1] for k, n in grow.items())
            if self.budget_bytes is not None and self.live_bytes + extra > self.budget_bytes:
                self.oom_count += 1
                self.last_oom = self._oom_report(extra, op)
                raise simulated_oom(extra, self.live_bytes, self.budget_bytes)
            for key, (st, nbytes) in new.items():
                ref = weakref.ref(st, lambda r, k=key: self._on_free(k, r))
                self._refs[key] = (ref, nbytes)
                self._ops[key] = op
            for key, nbytes in grow.items():
                self._refs[key] = (self._refs[key][0], nbytes)
            self.live_bytes += extra
            self.charged_total += extra
            self._bump_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = tensors_in(out)
        try:
            # The inputs are still referenced here, so their storages are the ones they had.
            self._charge_outputs(flat, (args, kwargs), func)
        except torch.OutOfMemoryError:
            # Drop the outputs before raising, as a failed allocation would never have made them.
            del out, flat
            raise
        return out

    # -- windows ----------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new global peak from the bytes live now (open windows keep their own)."""
        self.peak_bytes = self.live_bytes

    def largest_live(self, n: int = 10) -> list[dict[str, Any]]:
        """The `n` largest storages charged now: bytes and the aten op that made each."""
        with self._lock:
            top = sorted(((e[1], k) for k, e in self._refs.items()), reverse=True)[:n]
            return [{"bytes": b, "op": str(self._ops.get(k))} for b, k in top]

    def _oom_report(self, requested: int, op: Any) -> dict[str, Any]:
        """What was live when an allocation failed (kept in `last_oom` for the incident record)."""
        return {"oom_count": self.oom_count, "requested_bytes": requested, "requested_by": str(op),
                "live_bytes": self.live_bytes, "budget_bytes": self.budget_bytes, "largest": self.largest_live()}

    def live_storages(self) -> int:
        """How many storages are charged now (for leak checks in tests)."""
        return len(self._refs)

    @contextmanager
    def window(self, name: str = "window") -> Iterator[Window]:
        """Run the body with tracking on and record its own peak (nested windows are independent)."""
        with self.watch(name) as w, self:
            yield w

    @contextmanager
    def watch(self, name: str = "watch") -> Iterator[Window]:
        """Record the peak of the body without counting the current thread's own ops.

        A step's window: the model calls inside it enter the tracker themselves (a host-placed
        model's never do), and every thread that counts raises the peak of every open window.
        """
        with self._lock:
            w = Window(name=name, start_bytes=self.live_bytes, peak_bytes=self.live_bytes)
            self._open.append(w)
        try:
            yield w
        finally:
            with self._lock:
                # by identity: two windows may compare equal as dataclasses
                self._open[:] = [o for o in self._open if o is not w]
                w.end_bytes = self.live_bytes
