"""Tests of the tensor-bytes tracker: views, in-place ops, inference mode, nesting, threads, budget."""

from __future__ import annotations

import threading

import pytest
import torch

from rewardstack._memory.device import TensorBytesTracker


def test_counts_new_storages_and_frees() -> None:
    tr = TensorBytesTracker()
    with tr:
        a = torch.ones(100)  # 400 bytes
        b = torch.ones(50, dtype=torch.float64)  # 400 bytes
        assert tr.live_bytes == 800
    del a
    assert tr.live_bytes == 400  # frees are seen after the tracker exits too
    del b
    assert tr.live_bytes == 0 and tr.largest_live() == []  # no storage still charged
    assert tr.peak_bytes == 800


def test_views_inplace_and_outside_storages_are_not_charged() -> None:
    w = torch.randn(100, 100)  # a "weight", made before the tracker: never charged
    tr = TensorBytesTracker()
    with torch.inference_mode(), tr:
        x = torch.randn(4, 100)
        base = tr.live_bytes
        v = w.t()  # view of the weight
        w2 = w.view(-1)
        y = torch.nn.functional.linear(x, w)  # decomposes into t() + addmm
        assert tr.live_bytes == base + y.numel() * 4
        x.add_(1)  # in place
        x2 = x[1:]  # view of a tracked storage
        out = torch.empty(4, 100)
        torch.mul(y, 2, out=out)
        assert tr.live_bytes == base + 2 * 1600
        del v, w2, x2
    assert tr.live_bytes == base + 3200


def test_resize_charges_growth_once() -> None:
    tr = TensorBytesTracker()
    with tr:
        a = torch.empty(100)
        a.resize_(300)
        assert tr.live_bytes == 1200
    del a
    assert tr.live_bytes == 0


def test_budget_raises_oom_and_keeps_accounting() -> None:
    tr = TensorBytesTracker(budget_bytes=1000)
    with tr:
        a = torch.ones(200)  # 800
        with pytest.raises(torch.OutOfMemoryError, match="Simulated device out of memory"):
            torch.ones(100)  # +400 > 1000
        assert tr.live_bytes == 800 and tr.oom_count == 1
        del a
        b = torch.ones(250)  # fits after the free
        assert tr.live_bytes == 1000
    del b


def test_nested_windows_have_their_own_peaks() -> None:
    tr = TensorBytesTracker()
    with tr.window("outer") as outer:
        a = torch.ones(1000)  # 4000
        with tr.window("inner") as inner:
            b = torch.ones(500)  # 2000
            del b
        c = torch.ones(2000)  # 8000
        del c
    assert inner.start_bytes == 4000 and inner.peak_increase == 2000
    assert outer.peak_increase == 12000
    del a


def test_reentrant_enter_does_not_double_push() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    tr = TensorBytesTracker()
    with tr, tr, tr.window("w"):
        assert sum(m is tr for m in _get_current_dispatch_mode_stack()) == 1
        x = torch.ones(10)
    assert not any(m is tr for m in _get_current_dispatch_mode_stack())
    assert tr.live_bytes == 40
    del x


def test_inference_mode_tensors_are_counted() -> None:
    tr = TensorBytesTracker()
    with torch.inference_mode(), tr.window() as w:
        x = torch.randn(64, 64)
        y = x @ x
        del x, y
    assert w.peak_increase == 2 * 64 * 64 * 4 and tr.live_bytes == 0


def test_threads_share_counters_when_each_enters() -> None:
    tr = TensorBytesTracker()
    barrier = threading.Barrier(4)
    keep: list[torch.Tensor] = []
    lock = threading.Lock()

    def work() -> None:
        with tr:
            t = torch.ones(1000)
            barrier.wait()  # all four alive at once
            with lock:
                keep.append(t)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tr.live_bytes == 16000 and tr.peak_bytes == 16000
    keep.clear()
    assert tr.live_bytes == 0
