"""Tests of model placement on a simulated device: residency, CPU, LRU swaps, the manager hook."""

from __future__ import annotations

import logging

import pytest
import torch

from memory_fixtures import FakeCard
from rewardstack.config import StackConfig
from rewardstack._memory import MemoryManager, Placement
from rewardstack._memory.budget import ACTIVATION_SHARE, Card, split_card, usable_bytes, weights_bytes


def _mod(n_floats: int) -> torch.nn.Module:
    m = torch.nn.Linear(1, 1, bias=False)
    m.weight = torch.nn.Parameter(torch.zeros(n_floats, 1), requires_grad=False)
    return m


MiB = 1024**2
GiB = 1024**3


def test_everything_resident_when_it_fits() -> None:
    p = Placement("cpu", 10 * MiB)
    p.register("a", [_mod(MiB // 4)])  # 1 MiB
    p.register("b", [_mod(MiB // 2)])
    assert {d.where for d in p.plan().values()} == {"resident"}


def test_over_budget_small_to_cpu_big_swapped_lru(caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.INFO, "rewardstack.memory")
    p = Placement("cpu", 10 * MiB)
    p.register("filter", [_mod(MiB // 8)], cpu_ok=True)  # 0.5 MiB, small
    p.register("big1", [_mod(MiB)])  # 4 MiB each
    p.register("big2", [_mod(MiB)])
    p.register("big3", [_mod(MiB)])
    p.register("huge", [_mod(3 * MiB)])  # 12 MiB > budget
    dec = p.plan()
    assert dec["filter"].where == "cpu" and dec["huge"].where == "cpu"
    assert dec["big1"].where == "resident"
    assert {dec["big2"].where, dec["big3"].where} == {"swap"}
    for name in ["big2", "big3", "big2", "big2", "big3"]:
        p.ensure(name)
        assert p.device_bytes() <= 10 * MiB
        assert p.where(name) == p.device
    assert p.swaps == 4 and p.evictions == 3  # big2 twice in a row costs nothing
    s = p.summary()
    assert s["swaps"] == 4 and s["models"]["huge"]["where"] == "cpu"
    assert "placement: huge -> cpu" in caplog.text and "swapped in big3" in caplog.text


def test_shared_modules_count_once_and_stay() -> None:
    shared = _mod(MiB // 2)  # 2 MiB
    p = Placement("cpu", 5 * MiB)
    p.register("relevance", [shared, _mod(MiB // 4)])
    p.register("diversity", [shared])
    p.register("other", [_mod(MiB // 2)])
    assert p.total_bytes() == 5 * MiB
    assert {d.where for d in p.plan().values()} == {"resident"}


def test_manager_runs_every_model_with_budget_below_weights(caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.INFO, "rewardstack.memory")
    mm = MemoryManager(None)
    mods = {n: _mod(MiB) for n in ("a", "b", "c")}  # 4 MiB each, 12 MiB in all
    for n, m in mods.items():
        mm.register_model(n, [m])
    mm.register_model("tiny", [_mod(1024)], cpu_ok=True)
    budget = mm.setup(StackConfig(memory_budget=9 * MiB))
    assert budget.activation_bytes == 9 * MiB
    for step in range(3):
        for n in ("a", "b", "c", "tiny"):
            out = mm.run(n, [3, 4], lambda idx: [float(i) for i in idx])
            assert [o.value for o in out] == [0.0, 1.0]
    summ = mm.placement.summary()
    assert summ["swaps"] >= 3 and summ["models"]["tiny"]["where"] == "cpu"
    assert "placement:" in caplog.text


def test_budget_resolution() -> None:
    # One rule on every device: `Card.resolve`, which `MemoryManager.setup` applies.
    cfg = StackConfig()
    cpu = Card(torch.device("cpu"))  # no card: memory_budget, else unlimited
    assert cpu.resolve(cfg, 0)[0].activation_bytes is None
    assert cpu.resolve(StackConfig(memory_budget=123), 0)[0].activation_bytes == 123
    card = Card(torch.device("cuda"), FakeCard(80 * GiB, 80 * GiB))
    usable = int(80 * GiB * 0.9) - 512 * MiB
    b, weights_budget = card.resolve(cfg, 10 * GiB)
    assert weights_budget is None and b.activation_bytes == usable - 10 * GiB
    assert "total" in b.describe()
    # Weights that do not fit: placement fills its share, the passes keep ACTIVATION_SHARE of the card.
    tight, weights_budget = card.resolve(cfg, 100 * GiB)
    assert weights_budget == int(usable * (1 - ACTIVATION_SHARE))
    assert tight.activation_bytes == usable - weights_budget > 0
    assert weights_bytes([torch.nn.Linear(4, 4)]) == (16 + 4) * 4


def test_setup_on_simulated_cuda_places_when_weights_do_not_fit() -> None:
    mm = MemoryManager(None, snapshot=FakeCard(8 * MiB, 8 * MiB))
    for n in ("a", "b"):
        mm.register_model(n, [_mod(MiB)])  # 4 MiB each
    b = mm.setup(StackConfig(headroom_bytes=1))
    assert b.activation_bytes and b.activation_bytes > 0
    assert mm.placement is not None and "swap" in {d.where for d in mm.placement.decisions.values()}


def test_setup_on_simulated_cuda_with_a_fixed_activation_budget() -> None:
    # memory_budget fixes the activations; the card's size still decides what the weights get.
    mm = MemoryManager(None, snapshot=FakeCard(8 * MiB, 8 * MiB))
    for n in ("a", "b"):
        mm.register_model(n, [_mod(MiB)])  # 4 MiB each
    b = mm.setup(StackConfig(headroom_bytes=1, memory_budget=MiB))
    assert b.activation_bytes == MiB and mm.budget_bytes == MiB
    assert mm.placement is not None and mm.placement.budget_bytes is not None and mm.placement.budget_bytes > 0
    assert "swap" in {d.where for d in mm.placement.decisions.values()}


def test_models_start_where_their_weights_are() -> None:
    # A model already on the device is known to be there, so offloading it really moves it.
    p = Placement("cpu", 3 * MiB, move=False)
    p.register("big", [_mod(MiB)])  # 4 MiB: more than the whole budget
    assert p.device_bytes() == 4 * MiB  # loaded onto the device before placement
    p.plan()
    assert p.decisions["big"].where == "cpu" and p.device_bytes() == 0


def test_place_then_load_moves_only_resident_models_to_the_card() -> None:
    # The "card" is the meta device here: a module moved there holds no memory and says so.
    mm = MemoryManager(None)
    assert mm.card.size(StackConfig()) is None  # CPU: no card to fill
    full = StackConfig(headroom_bytes=0, gpu_utilization=1.0)
    card = Card(torch.device("cpu"), FakeCard(9 * MiB, 9 * MiB)).size(full)
    cap, _ = split_card(usable_bytes(card, full), 9 * MiB, None)  # weights do not fit
    assert cap == int(9 * MiB * (1 - ACTIVATION_SHARE)) == int(9 * MiB * 0.8)  # 7.2 MiB
    mods = {"a": _mod(MiB), "b": _mod(MiB), "c": _mod(MiB // 2)}  # 4, 4 and 2 MiB, loaded on the host
    p = Placement("meta", 7 * MiB)
    for name, m in mods.items():
        p.register(name, [m])
    assert p.device_bytes() == 0  # nothing on the card before placement decides
    p.plan()
    on_card = {n for n, m in mods.items() if next(m.parameters()).device.type == "meta"}
    assert on_card == {n for n, d in p.decisions.items() if d.where == "resident"} and on_card
    assert p.device_bytes() <= 7 * MiB and "swap" in {d.where for d in p.decisions.values()}


def test_model_cache_loads_on_the_host(tmp_path) -> None:  # noqa: ANN001
    from transformers import BertConfig, BertModel

    from rewardstack._scorers.loading import ModelCache

    BertModel(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(str(tmp_path), safe_serialization=True)
    cache = ModelCache(torch.device("meta"))  # stands for a card: nothing may land there while loading
    model = cache.model(str(tmp_path), BertModel)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def _three_in_two_slots() -> tuple[Placement, dict[str, torch.nn.Module]]:
    """Three 4 MiB models under a 9 MiB weight budget: one resident, two sharing a swap slot."""
    mods = {n: _mod(MiB) for n in ("a", "b", "c")}
    p = Placement("cpu", 9 * MiB)
    for n, m in mods.items():
        p.register(n, [m])
    dec = p.plan()
    assert [dec[n].where for n in "abc"] == ["resident", "swap", "swap"]
    return p, mods


def test_prefetch_evicts_for_the_next_model_but_never_the_busy_one() -> None:
    p, _ = _three_in_two_slots()
    p.ensure("c")
    assert p.prefetch("b", busy="c") is False  # only c's slot: b would evict the model running
    assert p.where("c") == p.device and p.swaps == 1
    assert p.prefetch("b", busy="a") is True  # a resident model runs: c's slot is free to take
    assert p.where("b") == p.device and p.where("c") == p.host and (p.swaps, p.evictions, p.prefetches) == (2, 1, 1)
    p.ensure("b")  # the prefetched model is in: no second swap
    assert p.swaps == 2 and p.device_bytes() <= 9 * MiB
    assert p.prefetch("b", busy="a") is False and p.prefetch("a") is False  # in already; resident
    assert p.prefetch("c", busy="b") is False and p.swaps == 2


def test_prefetch_refuses_when_the_busy_model_is_not_on_the_device() -> None:
    p, _ = _three_in_two_slots()
    p.ensure("b")
    assert p.prefetch("b", busy="c") is False and p.prefetch("c", busy="b") is False
    assert p.prefetch("c", busy=None) is True and p.where("b") == p.host


def test_prefetch_tells_observers_without_a_time() -> None:
    p, _ = _three_in_two_slots()
    moves = []
    p.on_move = moves.append
    p.ensure("b")
    p.prefetch("c", busy="a")
    assert [(m.model, m.direction, m.seconds is None) for m in moves] == [
        ("b", "in", False), ("c", "in", True), ("b", "out", True)]


def test_host_bytes_are_the_swapped_models_pinned_and_host_models_pageable() -> None:
    p, _ = _three_in_two_slots()
    assert p.host_bytes() == (8 * MiB, 0)
    p.register("filter", [_mod(MiB // 64)], cpu_ok=True)  # 64 KiB <= budget / 16: on the host
    p.plan()
    assert p.decisions["filter"].where == "cpu" and p.host_bytes() == (8 * MiB, 64 * 1024)
    assert p.swapper is None  # no pinned copies off CUDA: the simulated device moves nothing


def test_expect_changes_nothing_without_pinned_swaps() -> None:
    """On CPU, the manager's `expect` (the stack's hint of the next model) moves and counts nothing:
    the same swaps and evictions as without it."""
    counts = []
    for hint in (False, True):
        mm = MemoryManager(None)
        for n in ("a", "b", "c"):
            mm.register_model(n, [_mod(MiB)])
        mm.setup(StackConfig(memory_budget=9 * MiB))
        for _ in range(3):
            for n, after in (("a", "b"), ("b", "c"), ("c", "a")):
                if hint:
                    mm.expect(after)
                mm.run(n, [3], lambda idx: [0.0 for _ in idx])
        counts.append((mm.placement.swaps, mm.placement.evictions))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_pinned_slabs_pack_copies_and_count_what_the_allocator_takes() -> None:
    """Pinned copies go in slabs of 1 GiB, first fit, so the pinned allocator's rounding up to a
    power of two costs at most the last slab's: a Llama-3-8B layer's seven projections and two
    norms, 32 times, take 14 slabs, 0.2% over the weights (one allocation a tensor: 11% over)."""
    from rewardstack._memory.pinned import ALIGN, SLAB, pinned_footprint, slab_layout

    layer = [4096 * 4096 * 2, 1024 * 4096 * 2, 1024 * 4096 * 2, 4096 * 4096 * 2] + [14336 * 4096 * 2] * 3 + [8192] * 2
    sizes = [128256 * 4096 * 2] + layer * 32 + [8192, 4096 * 2]  # embeddings, layers, final norm, score head
    used, where = slab_layout(sizes)
    assert len(used) == 14 and all(u <= SLAB for u in used)
    for (k, off), n in zip(where, sizes):  # no two copies overlap, each at an aligned offset
        assert off % ALIGN == 0 and off + n <= used[k]
    spans = sorted((k, off, off + n) for (k, off), n in zip(where, sizes))
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
    assert pinned_footprint(sizes) == 13 * SLAB + (1 << (used[-1] - 1).bit_length())
    one_by_one = sum(1 << (n - 1).bit_length() for n in sizes)
    assert one_by_one > 1.10 * sum(sizes) and pinned_footprint(sizes) < 1.002 * sum(sizes)
    assert pinned_footprint([3 * 1024**2]) == 4 * 1024**2 and pinned_footprint([SLAB + 1]) == 2 * SLAB
