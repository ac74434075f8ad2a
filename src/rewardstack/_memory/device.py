"""The device: what memory holds now and at its peak, on a CUDA card or on the simulated device.

- **The simulated device** (`TensorBytesTracker`): a PyTorch dispatch mode that charges every storage
  an aten op *creates* while it is active until that storage is freed, records the peak per window,
  and raises the same `torch.OutOfMemoryError` a CUDA allocation raises when an allocation would
  pass `budget_bytes`. Weights created before the tracker is entered are not charged, so the budget
  is the activation budget, as on a GPU where weights are already resident. Accounting is by
  storage: a view, an in-place op or an `out=` op returns one of its inputs' storages and is never
  charged again; a storage that grows in place (`resize_`) is charged the difference. Frees are
  seen through a weakref callback on the storage's Python object, which PyTorch keeps alive exactly
  as long as the storage. PyTorch's dispatch-mode stack is thread-local, so each thread that should
  be counted enters the tracker itself (`with tracker:`, re-entrant per thread); the counters are
  shared and locked. Meta tensors count too (a meta storage has a size and no data), which is how
  `rewardstack._planning.simulate` measures full-size models on a laptop. Memory a kernel allocates
  and frees internally (a fused attention's workspace) is invisible, as are tensors made outside
  any aten op.
- **Snapshots** (`MemorySnapshot`, `take_snapshot`): one record of where memory stands:
  on CUDA the caching allocator's statistics, the device's free and total bytes and, with
  `nvidia-ml-py`, the driver's view; on CPU the tracker's figures; the process's resident set on
  both. A figure that cannot be measured is None, never guessed.
- **Peak windows** (`PeakWindow`): the peak of one stretch of work above what was live when it
  opened, nestable (the step's window around each call's, replay's around a model's run). On CPU a
  window of the tracker; on CUDA the allocator has one peak counter per device, so every reset goes
  through the process's one ledger (`cuda_window`), which first folds the counter into every open window: a
  reset never loses an outer window's peak. The counters are read through `torch.cuda`'s functions
  at call time, so tests stand a fake allocator in for them without a GPU.
- **Allocator settings**: `configure_allocator()` sets `expandable_segments:True` before CUDA
  starts (PyTorch reads PYTORCH_CUDA_ALLOC_CONF once; a user's own setting is left alone), and
  `maybe_empty_cache()` returns cached blocks only when measured fragmentation crosses a threshold
  (emptying every step costs a device sync and cudaFree/cudaMalloc churn).
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

try:  # optional: the driver's view of the card (`pip install nvidia-ml-py`)
    import pynvml as _pynvml
except ImportError:  # the fields stay absent
    _pynvml = None

log = logging.getLogger("rewardstack.memory")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_CONF = "expandable_segments:True"


@dataclass
class Window:
    """Peak and live bytes seen inside one named window: a `TensorBytesTracker.window` (or `watch`),
    or a CUDA window of the ledger (`cuda_window`, named by its device)."""

    name: str
    start_bytes: int = 0
    peak_bytes: int = 0

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
    on the meta device is charged exactly the bytes it would allocate (`planning.simulate`). A
    sparse tensor has no storage to reach (`untyped_storage` raises)."""
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
        # id(storage object) -> (weakref to it, bytes charged, the aten op that made it: OOM forensics).
        # PyTorch keeps one Python object per live storage, so the id is stable while the storage
        # lives and survives reallocation.
        self._refs: dict[int, tuple[weakref.ref, int, Any]] = {}
        self.last_oom: dict[str, Any] | None = None  # what was live at the last simulated OOM
        self._lock = threading.RLock()
        self._open: list[Window] = []  # every window open now, in any thread
        self._tls = threading.local()

    # -- entering (re-entrant per thread) -----------------------------------------------------
    def __enter__(self) -> "TensorBytesTracker":
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            # Pushing the same mode twice would run every op through it twice; count instead.
            self._tls.pushed = not any(m is self for m in _get_current_dispatch_mode_stack())
            if self._tls.pushed:
                super().__enter__()
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
                self.live_bytes -= entry[1]

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
                # What was live when the allocation failed (kept for the incident record).
                self.last_oom = {"oom_count": self.oom_count, "requested_bytes": extra, "requested_by": str(op),
                                 "live_bytes": self.live_bytes, "budget_bytes": self.budget_bytes,
                                 "largest": self.largest_live()}
                gib = 1024**3  # worded like CUDA's
                raise torch.OutOfMemoryError(
                    f"Simulated device out of memory. Tried to allocate {extra / gib:.2f} GiB "
                    f"({self.live_bytes / gib:.2f} GiB already allocated; budget {self.budget_bytes / gib:.2f} GiB)")
            for key, (st, nbytes) in new.items():
                ref = weakref.ref(st, lambda r, k=key: self._on_free(k, r))
                self._refs[key] = (ref, nbytes, op)
            for key, nbytes in grow.items():
                ref, _, made_by = self._refs[key]
                self._refs[key] = (ref, nbytes, made_by)
            self.live_bytes += extra
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
            for w in self._open:
                if self.live_bytes > w.peak_bytes:
                    w.peak_bytes = self.live_bytes

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
    def largest_live(self, n: int = 10) -> list[dict[str, Any]]:
        """The `n` largest storages charged now: bytes and the aten op that made each."""
        with self._lock:
            top = sorted(((e[1], k) for k, e in self._refs.items()), reverse=True)[:n]
            return [{"bytes": b, "op": str(self._refs[k][2])} for b, k in top]

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


@dataclass
class MemorySnapshot:
    """Memory figures at one moment, in bytes (counters are counts). None: not measured here.

    `source` says where the device figures come from: `cuda` (the caching allocator), `tracker`
    (the simulated device on CPU) or `host` (no device figures, only the process's memory).
    """

    time: float
    source: str
    allocated: int | None = None
    """Bytes held by live tensors (`allocated_bytes.all.current`; the tracker's live bytes)."""
    reserved: int | None = None
    """Bytes the allocator holds from the driver (`reserved_bytes.all.current`)."""
    active: int | None = None
    """Bytes in active blocks (`active_bytes.all.current`)."""
    inactive_split: int | None = None
    """Bytes in split blocks that hold no tensor: fragmentation the allocator cannot release."""
    peak: int | None = None
    """Highest allocated bytes since the peak was last reset (a window opened)."""
    num_alloc_retries: int | None = None
    """Times a device allocation failed, the cache was flushed and the allocation retried."""
    num_ooms: int | None = None
    """Out-of-memory errors the allocator (or the simulated device) raised."""
    device_free: int | None = None
    """Free bytes on the device (`torch.cuda.mem_get_info`; budget minus live on the simulated device)."""
    device_total: int | None = None
    """The device's size (`mem_get_info`; the simulated device's budget)."""
    nvml_used: int | None = None
    """Bytes in use on the card as the driver sees it, every process included (NVML only)."""
    nvml_free: int | None = None
    """Free bytes as the driver sees them (NVML only)."""
    nvml_total: int | None = None
    """The card's size as the driver sees it (NVML only)."""
    host_rss: int | None = None
    """Resident set size of this process."""
    host_rss_peak: int | None = None
    """High-water mark of the resident set size (`ru_maxrss`)."""

    @property
    def fragmentation(self) -> int | None:
        """Reserved bytes that hold no live tensor (reserved minus allocated)."""
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated

    @property
    def inactive_split_share(self) -> float | None:
        """Share of the reserved bytes in inactive split blocks (0 to 1)."""
        if not self.reserved or self.inactive_split is None:
            return None
        return self.inactive_split / self.reserved

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; figures not measured are left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        """One line for logs: the device's figures this snapshot has."""
        gib = 1024**3
        parts = [form.format(v / gib) for form, v in (
            ("{:.2f} GiB total", self.device_total), ("{:.2f} GiB free", self.device_free),
            ("torch reserved {:.2f} GiB", self.reserved), ("allocated {:.2f} GiB", self.allocated)) if v is not None]
        return ", ".join(parts) or f"no device figures ({self.source})"


def process_rss() -> tuple[int | None, int | None]:
    """(resident set size, its high-water mark) of this process, in bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            rss: int | None = int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # not Linux
        rss = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    peak_bytes = peak if os.uname().sysname == "Darwin" else peak * 1024
    return rss, peak_bytes


_nvml_handles: dict[int, Any] = {}


def _nvml(device: torch.device) -> tuple[int, int, int] | None:  # pragma: no cover - CUDA-only path
    """(used, free, total) from NVML, or None without nvidia-ml-py or a driver."""
    if _pynvml is None:
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _nvml_handles:
            _pynvml.nvmlInit()
            _nvml_handles[index] = _pynvml.nvmlDeviceGetHandleByIndex(index)
        info = _pynvml.nvmlDeviceGetMemoryInfo(_nvml_handles[index])
        return int(info.used), int(info.free), int(info.total)
    except Exception:  # noqa: BLE001 - an optional extra must never stop scoring
        return None


CUDA_STATS = {"allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current",
              "active": "active_bytes.all.current", "inactive_split": "inactive_split_bytes.all.current",
              "peak": "allocated_bytes.all.peak", "num_alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}
"""The `MemorySnapshot` fields read from the caching allocator's `torch.cuda.memory_stats`."""


def cuda_snapshot(device: torch.device, *, nvml: bool = False) -> MemorySnapshot:  # pragma: no cover - CUDA-only path
    """The caching allocator's figures and the device's free and total bytes now (NVML's too with
    `nvml`); the process's memory is left out (`take_snapshot` adds it)."""
    s = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    snap = MemorySnapshot(time.time(), "cuda", **{k: int(s.get(v, 0)) for k, v in CUDA_STATS.items()},
                          device_free=int(free), device_total=int(total))
    v = _nvml(device) if nvml else None
    if v is not None:
        snap.nvml_used, snap.nvml_free, snap.nvml_total = v
    return snap


def take_snapshot(device: torch.device | str = "cpu", tracker: TensorBytesTracker | None = None) -> MemorySnapshot:
    """Memory now: the CUDA allocator's figures (the driver's too, with NVML), or the simulated
    device's, plus the process's RSS."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and tracker is None:  # pragma: no cover - CUDA-only path
        snap = cuda_snapshot(dev, nvml=True)
    elif tracker is not None:
        live = tracker.live_bytes
        budget = tracker.budget_bytes
        # The simulated device has no cache: everything reserved is allocated, nothing is split.
        snap = MemorySnapshot(
            time=time.time(), source="tracker", allocated=live, reserved=live, active=live, inactive_split=0,
            peak=tracker.peak_bytes, num_alloc_retries=0, num_ooms=tracker.oom_count,
            device_free=None if budget is None else max(0, budget - live), device_total=budget,
        )
    else:
        snap = MemorySnapshot(time=time.time(), source="host")
    snap.host_rss, snap.host_rss_peak = process_rss()
    return snap


def allocated_bytes(device: torch.device | str) -> tuple[int, int]:
    """The CUDA allocator's bytes in live tensors on `device`: (now, peak since the last reset).

    Read from the allocator's nested counters in one call: `torch.cuda.memory_allocated` and
    `max_memory_allocated` each flatten every counter into a new dict first, ~0.1 ms apiece, which
    was most of what telemetry cost a short pass on a card (docs/TELEMETRY.md)."""
    counters = torch.cuda.memory.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
    return int(counters.get("current", 0)), int(counters.get("peak", 0))


_ledger_lock = threading.Lock()
_ledger: dict[str, list[Window]] = {}
"""The allocator's peak counter, owned: the CUDA windows open on each device (`cuda_window` makes the only resets)."""


def _fold(device: torch.device) -> int:
    """Fold the peak counter into the open windows of `device`; the bytes live now."""
    now, peak = allocated_bytes(device)
    for w in _ledger.get(str(device), ()):
        w.peak_bytes = max(w.peak_bytes, peak)
    return now


@contextmanager
def cuda_window(device: torch.device) -> Iterator[Window]:
    """A window on `device`: opening folds the counter into the open ones, then resets it; closing
    folds the peak (absolute bytes) in. The outer windows keep theirs."""
    with _ledger_lock:
        start = _fold(device)
        torch.cuda.reset_peak_memory_stats(device)
        w = Window(str(device), start, start)
        _ledger.setdefault(str(device), []).append(w)
    try:
        yield w
    finally:
        with _ledger_lock:
            _fold(device)
            windows = _ledger.get(str(device), [])
            windows[:] = [o for o in windows if o is not w]


class PeakWindow:
    """Peak bytes of a stretch of work above what was live when it opened (nestable, see the module).

    CPU: a window of the tracker, when the tracker counts the current thread (a model run in host
    memory has no device peak: None; with `watch=True`, a step's window, the peak of the calls inside
    that count). CUDA: a window of the process's ledger (`cuda_window`). Use as a context
    manager; read `start`, `peak` and `peak_increase` after.
    """

    def __init__(self, device: torch.device | str, tracker: TensorBytesTracker | None, *, watch: bool = False) -> None:
        self.device = torch.device(device)
        self.tracker = tracker
        self.watch = watch  # a stretch of several calls (a step): watch the tracker without entering it
        self.start: int | None = None
        self.peak: int | None = None
        self._cm: Any = None  # the tracker's window or watch, or the ledger's
        self._window: Window | None = None

    @property
    def peak_increase(self) -> int | None:
        """Peak bytes above the start (None when nothing was measured)."""
        if self.start is None or self.peak is None:
            return None
        return self.peak - self.start

    def __enter__(self) -> "PeakWindow":
        t = self.tracker
        if t is not None and (t.is_active() or self.watch):
            # Never start counting a thread that runs in host memory; a step's window (`watch`) only
            # watches: the calls inside enter the tracker themselves.
            self._cm = t.window("call") if t.is_active() else t.watch("step")
        elif t is None and self.device.type == "cuda":
            self._cm = cuda_window(self.device)
        if self._cm is not None:
            self._window = self._cm.__enter__()
            self.start = self._window.start_bytes
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)
            self.peak = self._window.peak_bytes


def configure_allocator(environ: dict[str, str] | None = None) -> str | None:
    """Set expandable segments unless the user chose allocator settings; return the setting in force.

    Warns (and changes nothing) if CUDA is already initialized, since the setting would be ignored.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV):
        log.info("allocator: keeping the user's %s=%s", ENV, env[ENV])
        return env[ENV]
    if torch.cuda.is_initialized():
        log.warning(
            "allocator: CUDA is already initialized, %s=%s would be ignored; call configure_allocator() "
            "before the first CUDA call", ENV, DEFAULT_CONF,
        )
        return None
    env[ENV] = DEFAULT_CONF
    log.info("allocator: %s=%s", ENV, DEFAULT_CONF)
    return DEFAULT_CONF


def _cuda_empty(device: torch.device) -> None:  # pragma: no cover - CUDA-only path
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


def maybe_empty_cache(
    device: torch.device | str,
    threshold: int = 1024**3,
    *,
    split_threshold: int | None = None,
    stats: Callable[[torch.device], Mapping[str, int]] | None = None,
    empty: Callable[[torch.device], None] | None = None,
) -> str | None:
    """Empty the CUDA cache only if reserved-allocated > `threshold` or inactive split bytes > `split_threshold`;
    returns why it did (None: the cache was kept).

    `split_threshold` defaults to half of `threshold`. `stats`/`empty` replace the CUDA calls (tests).
    On a non-CUDA device without injected stats nothing is done.
    """
    dev = torch.device(device)
    if dev.type != "cuda" and stats is None:
        return None
    s = (stats or torch.cuda.memory_stats)(dev)
    reserved, allocated, inactive = (int(s.get(CUDA_STATS[k], 0)) for k in ("reserved", "allocated", "inactive_split"))
    split_limit = threshold // 2 if split_threshold is None else split_threshold
    if reserved - allocated > threshold:
        reason = f"reserved-allocated {reserved - allocated} > {threshold}"
    elif inactive > split_limit:
        reason = f"inactive split {inactive} > {split_limit}"
    else:
        return None
    (empty or _cuda_empty)(dev)
    log.info("allocator: emptied the cache (%s)", reason)
    return reason
