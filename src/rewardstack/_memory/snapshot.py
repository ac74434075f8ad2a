"""Memory snapshots: one subtractable record of where memory stands, on CUDA and on CPU alike.

`take_snapshot(device, tracker)` reads, on CUDA, the caching allocator's statistics
(`torch.cuda.memory_stats`), the device's free and total bytes (`torch.cuda.mem_get_info`) and, when
`nvidia-ml-py` is installed, the driver's view of the card (which sees memory that is not
PyTorch's: the CUDA context, another process). On CPU the device figures come from the simulated
device, the tensor-bytes tracker (`rewardstack._memory.tracker`); the process's resident set size and
its high-water mark are read on both. A figure that cannot be measured is None and left out of the
record, never guessed.

The one snapshot type of the memory layer: the memory manager's card readings (`sizing.Card`:
the device at start and now, from which the budget and the memory outside torch are computed) are
`cuda_snapshot`s, the telemetry's records `take_snapshot`s; `cuda_allocated` and
`cuda_total_memory` read one figure of the same sources where a whole snapshot is not needed.

The peak of one stretch of work (a model call, a step) is `rewardstack._memory.peaks.PeakWindow`.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from rewardstack._memory.tracker import TensorBytesTracker

try:  # optional: the driver's view of the card (`pip install nvidia-ml-py`)
    import pynvml as _pynvml
except ImportError:  # the fields stay absent
    _pynvml = None

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class MemorySnapshot:
    """Memory figures at one moment, in bytes (counters are counts). None: not measured here.

    `source` says where the device figures come from: `cuda` (the caching allocator), `tracker`
    (the simulated device on CPU) or `host` (no device figures, only the process's memory).
    Subtracting two snapshots of the same source gives the change of every figure both have.
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

    def __sub__(self, other: "MemorySnapshot") -> "MemorySnapshot":
        """The change from `other` to this one: every figure both snapshots have, and the seconds."""
        if not isinstance(other, MemorySnapshot):
            return NotImplemented
        if other.source != self.source:
            raise ValueError(f"cannot subtract a {other.source} snapshot from a {self.source} one")
        out: dict[str, Any] = {"time": self.time - other.time, "source": self.source}
        for f in fields(self):
            if f.name in ("time", "source"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = a - b if a is not None and b is not None else None
        return MemorySnapshot(**out)

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


def host_memory() -> tuple[int | None, int | None]:
    """(resident set size, its high-water mark) of this process, in bytes."""
    rss: int | None = None
    try:
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE
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


def cuda_snapshot(device: torch.device, *, nvml: bool = False) -> MemorySnapshot:  # pragma: no cover - CUDA-only path
    """The caching allocator's figures and the device's free and total bytes now (NVML's too with
    `nvml`); the process's memory is left out (`take_snapshot` adds it)."""
    s = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    snap = MemorySnapshot(
        time=time.time(), source="cuda",
        allocated=int(s.get("allocated_bytes.all.current", 0)),
        reserved=int(s.get("reserved_bytes.all.current", 0)),
        active=int(s.get("active_bytes.all.current", 0)),
        inactive_split=int(s.get("inactive_split_bytes.all.current", 0)),
        peak=int(s.get("allocated_bytes.all.peak", 0)),
        num_alloc_retries=int(s.get("num_alloc_retries", 0)),
        num_ooms=int(s.get("num_ooms", 0)),
        device_free=int(free), device_total=int(total),
    )
    v = _nvml(device) if nvml else None
    if v is not None:
        snap.nvml_used, snap.nvml_free, snap.nvml_total = v
    return snap


def cuda_allocated(device: torch.device) -> int:  # pragma: no cover - CUDA-only path
    """Bytes in live tensors now (a snapshot's `allocated`, read alone: once per guarded run)."""
    return int(torch.cuda.memory_allocated(device))


def cuda_total_memory(device: torch.device) -> int:  # pragma: no cover - CUDA-only path
    """The card's size (a snapshot's `device_total`, read alone)."""
    _free, total = torch.cuda.mem_get_info(device)
    return int(total)


def take_snapshot(
    device: torch.device | str = "cpu", tracker: TensorBytesTracker | None = None, *, nvml: bool = True
) -> MemorySnapshot:
    """Memory now: the CUDA allocator's figures, or the simulated device's, plus the process's RSS."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and tracker is None:  # pragma: no cover - CUDA-only path
        snap = cuda_snapshot(dev, nvml=nvml)
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
    snap.host_rss, snap.host_rss_peak = host_memory()
    return snap
