"""Telemetry's CUDA paths: allocator snapshots, peak windows, allocation history and its visualizer file.

Marked `gpu` and skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from rewardstack._memory.device import PeakWindow, take_snapshot
from rewardstack._telemetry.monitor import History
from rewardstack._telemetry.rundir import RunDir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1024**2


def test_cuda_snapshot_and_peak_window() -> None:
    dev = torch.device("cuda")
    before = take_snapshot(dev)
    assert before.source == "cuda" and before.device_total > 0 and before.reserved >= before.allocated
    with PeakWindow(dev, None) as w:
        x = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
        del x
    assert w.peak_increase is not None and abs(w.peak_increase - 64 * MIB) <= 2 * MIB
    kept = torch.empty(16 * MIB, dtype=torch.uint8, device=dev)
    assert take_snapshot(dev).allocated - before.allocated >= 16 * MIB
    del kept


def test_history_snapshot_is_written_for_the_visualizer(tmp_path) -> None:  # noqa: ANN001
    dev = torch.device("cuda")
    hist = History(dev, 1000)
    try:
        x = torch.empty(8 * MIB, dtype=torch.uint8, device=dev)
        snap = hist.capture()
        del x
        rd = RunDir(tmp_path)
        path = rd.incident({"step": 1, "model": "m"}, snapshot=snap)
        rd.close()
        written = sorted(p.name for p in (tmp_path / "incidents").iterdir())
        assert path.name in written and any(n.endswith(".snapshot.pickle") for n in written)
        # The visualizer's own CLI reads it (rewardstack never does).
        from torch.cuda import _memory_viz

        pickle_path = next(p for p in (tmp_path / "incidents").iterdir() if p.name.endswith(".pickle"))
        assert pickle_path.stat().st_size > 0 and hasattr(_memory_viz, "trace_plot")
    finally:
        hist.stop()
