"""Nestable peak windows and the memory layer's observers.

An outer window spanning several inner ones (the step around its model calls, replay's run around
the telemetry's batches) reports the largest inner peak: on CPU with the tensor-bytes tracker, and
on the CUDA path with a fake allocator standing in for `torch.cuda`'s own functions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rewardstack.config import StackConfig
from rewardstack._memory import MemoryManager, TensorBytesTracker
from tests.soak.faults import FaultInjector
from rewardstack._memory.manager import MemoryObserver
from rewardstack._memory.placement import PlacementMove
from rewardstack._memory.device import PeakWindow

CUDA = torch.device("cuda", 0)  # a device object only: nothing here runs on a GPU
BATCHES = (50, 30, 10)  # batches run largest first: the last inner peak is the smallest


class FakeAllocator:
    """A caching allocator's three counters (allocated, peak since reset, reset), in bytes."""

    def __init__(self, live: int = 100) -> None:
        self.current = live
        self.high = live
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.current += n
        self.high = max(self.high, self.current)

    def free(self, n: int) -> None:
        self.current -= n

    def allocated(self, device: torch.device) -> int:
        return self.current

    def peak(self, device: torch.device) -> int:
        return self.high

    def reset_peak(self, device: torch.device) -> None:
        self.high = self.current
        self.resets += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A fake allocator read through `torch.cuda`'s functions (what the peak ledger calls: the nested
    counters and the reset)."""
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict",
                        lambda device=None: {"allocated_bytes": {"all": {"current": fake.current, "peak": fake.high}}})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: fake.reset_peak(device))
    return fake


def _nested(fake: FakeAllocator) -> tuple[PeakWindow, list[PeakWindow]]:
    inners = []
    with PeakWindow(CUDA, None) as outer:
        for n in BATCHES:
            with PeakWindow(CUDA, None) as inner:
                fake.alloc(n)
                fake.free(n)
            inners.append(inner)
    return outer, inners


def test_outer_window_keeps_the_largest_inner_peak_on_cuda(fake: FakeAllocator) -> None:
    outer, inners = _nested(fake)
    assert [w.peak_increase for w in inners] == list(BATCHES)  # each inner window still its own peak
    assert outer.peak_increase == max(BATCHES)
    assert outer.start == 100 and outer.peak == 150


def test_a_peak_after_the_inner_windows_counts_for_the_outer_one(fake: FakeAllocator) -> None:
    with PeakWindow(CUDA, None) as outer:
        with PeakWindow(CUDA, None):
            fake.alloc(5)
            fake.free(5)
        fake.alloc(70)  # after the inner window closed, in the outer one only
        fake.free(70)
    assert outer.peak_increase == 70


def test_outer_window_keeps_the_largest_inner_peak_on_the_tracker() -> None:
    tracker = TensorBytesTracker(None)
    inners = []
    with tracker, PeakWindow("cpu", tracker) as outer:
        for n in BATCHES:
            with PeakWindow("cpu", tracker) as inner:
                t = torch.empty(n * 1024, dtype=torch.uint8)
                del t
            inners.append(inner)
    assert [w.peak_increase for w in inners] == [n * 1024 for n in BATCHES]
    assert outer.peak_increase == max(BATCHES) * 1024


class Recorder(MemoryObserver):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def run(self, name: str, lengths: Any) -> Any:
        self.events.append(("run", name, tuple(lengths)))
        return super().run(name, lengths)

    def batch(self, name: str, lengths: Any, forward: Any, cost: Any, on_host: bool, prefix: int = 0,
              completions: Any = None) -> Any:
        def counted(idx: list[int]) -> Any:
            self.events.append(("batch", name, tuple(idx)))
            return forward(idx)

        return counted

    def oom(self, record: Any) -> None:
        self.events.append(("oom", record.model, record.action))

    def moved(self, move: PlacementMove) -> None:
        self.events.append(("moved", move.model, move.direction))


def test_the_memory_layer_publishes_runs_batches_ooms_and_moves() -> None:
    mm = MemoryManager(None, injector=FaultInjector(1.0, seed=0))  # every batch runs out of memory
    rec = Recorder()
    mm.subscribe(rec)
    out = mm.run("m", [3, 4], lambda idx: [float(i) for i in idx], max_batch=2)
    assert [o.status for o in out] == ["oom", "oom"]
    kinds = [e[0] for e in rec.events]
    assert kinds[0] == "run" and "oom" in kinds and rec.events[0] == ("run", "m", (3, 4))
    assert sum(e[0] == "oom" for e in rec.events) == len(mm.oom_log)
    mm.unsubscribe(rec)
    mm.run("m", [3], lambda idx: [0.0])
    assert sum(e[0] == "run" for e in rec.events) == 1  # unsubscribed: told nothing more


def test_placement_moves_reach_the_subscribers() -> None:
    def mod() -> torch.nn.Module:
        m = torch.nn.Linear(1, 1, bias=False)
        m.weight = torch.nn.Parameter(torch.zeros(1024**2, 1), requires_grad=False)  # 4 MiB
        return m

    mm = MemoryManager(None)
    for n in ("a", "b", "c"):
        mm.register_model(n, [mod()])
    mm.setup(StackConfig(memory_budget=9 * 1024**2))
    rec = Recorder()
    mm.subscribe(rec)
    for n in ("a", "b", "c", "a", "b", "c"):
        mm.run(n, [2], lambda idx: [1.0])
    moves = [e for e in rec.events if e[0] == "moved"]
    assert sum(d == "in" for _, _, d in moves) == mm.placement.swaps >= 2
    assert any(d == "out" for _, _, d in moves)
    assert [e[0] for e in rec.events].count("batch") == 6
