"""Swaps from pinned host memory on a side CUDA stream (`rewardstack._memory.pinned`), run only where
a GPU is present (marked `gpu`, skipped cleanly on CPU; scripts/gpu-check.sh's card run runs them).

What they pin down: the weights that arrive are the weights that left, bit for bit, whether the
pass waits for the copy through `ensure` or the copy was started beside another pass (`prefetch`);
the host copies are pinned and kept, in the bytes the plan counts for them.
"""

from __future__ import annotations

import pytest
import torch

from rewardstack._memory import Placement
from rewardstack._memory.pinned import PinnedSwapper, module_tensors, pinned_footprint, tensor_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1024**2


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).eval()


def test_round_trip_keeps_the_weights_and_pins_the_host_copies() -> None:
    m = _model(1)
    expected = [t.detach().clone() for t in module_tensors(m)]
    sw = PinnedSwapper("cuda")
    sw.to_device(m, wait=False)
    sw.ready(m)
    assert all(t.device.type == "cuda" for t in module_tensors(m))
    assert all(torch.equal(t.cpu(), e) for t, e in zip(module_tensors(m), expected))
    sw.to_host(m)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in module_tensors(m))
    assert sw.pinned_bytes() == pinned_footprint(tensor_bytes(m)) >= sum(e.numel() * e.element_size() for e in expected)
    # A module first seen on the device is copied down into new pinned buffers.
    g = _model(2).cuda()
    want = [t.detach().cpu() for t in module_tensors(g)]
    sw.to_host(g)
    assert all(t.is_pinned() and torch.equal(t, w) for t, w in zip(module_tensors(g), want))


def test_copy_beside_a_running_pass_gives_the_pass_the_right_weights() -> None:
    """The placement's pinned path: b's copy starts (`prefetch`) while a resident model's large pass
    is queued, then `ensure` makes b's pass wait for it; b's output equals its CPU output."""
    mods = {n: _model(k) for k, n in enumerate("abc")}
    x = torch.randn(64, 512)
    with torch.inference_mode():
        want = {n: m(x) for n, m in mods.items()}
    size = sum(t.numel() * t.element_size() for t in module_tensors(mods["a"]))
    p = Placement("cuda", int(2.5 * size))
    assert p.swapper is not None
    for n, m in mods.items():
        p.register(n, [m])
    assert [p.plan()[n].where for n in "abc"] == ["resident", "swap", "swap"]
    assert all(t.is_pinned() for n in "bc" for t in module_tensors(mods[n]))  # pinned at plan
    xc = x.cuda()
    with torch.inference_mode():
        for _ in range(3):
            p.ensure("c")
            assert torch.allclose(mods["c"](xc).cpu(), want["c"], rtol=1e-3, atol=1e-4)
            big = torch.randn(4096, 4096, device="cuda")
            assert p.prefetch("b", busy="a")  # c out, b's copy under way on the side stream
            busy = [big @ big for _ in range(8)]  # a long pass queued beside the copy
            out_a = mods["a"](xc)
            p.ensure("b")
            assert torch.allclose(mods["b"](xc).cpu(), want["b"], rtol=1e-3, atol=1e-4)
            assert torch.allclose(out_a.cpu(), want["a"], rtol=1e-3, atol=1e-4)
            del busy, big
    assert p.device_bytes() <= int(2.5 * size) and p.host_bytes() == (2 * pinned_footprint(tensor_bytes(mods["b"])), 0)
    assert p.swapper.pinned_bytes() == p.host_bytes()[0]  # the plan's host line is what was pinned
    torch.cuda.synchronize()


def test_pageable_placement_stays_available() -> None:
    m = _model(3)
    p = Placement("cuda", None, pinned=False)
    p.register("m", [m])
    p.plan()
    assert p.swapper is None and next(m.parameters()).device.type == "cuda"
