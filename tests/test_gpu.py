"""CUDA paths, run only where a GPU is present (marked `gpu`, skipped cleanly on CPU).

On a GPU machine: `pytest -m gpu`. These check the parts that CPU tests simulate: the budget read
from the device, peaks read from the allocator, the allocator setting, cache emptying on measured
fragmentation, and the whole stand-in stack scoring on the device inside its budget.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import standin_config
from rewardstack import RewardStack
from rewardstack._memory import MemoryManager, configure_allocator, maybe_empty_cache
from rewardstack._memory.budget import usable_bytes
from tests.soak.synthetic import heavy_tailed_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_allocator_setting_precedes_cuda() -> None:
    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    started = torch.cuda.is_initialized()
    conf = configure_allocator()
    if user:
        assert conf == user  # the user's choice is kept
    elif started:
        assert conf is None  # too late to matter: said in a warning, nothing set
    else:
        assert conf == "expandable_segments:True" == os.environ["PYTORCH_CUDA_ALLOC_CONF"]


def test_budget_from_device(tmp_path) -> None:  # noqa: ANN001
    from rewardstack.config import from_dict

    cfg = from_dict({"device": "cuda:0", "state_dir": str(tmp_path)})
    _free, total = torch.cuda.mem_get_info(0)
    b, weights_budget = MemoryManager(None, device="cuda:0").card.resolve(cfg, 1024**3)
    assert b.source == "device" and b.total_bytes == total and weights_budget is None
    usable = usable_bytes(total, cfg, free_at_start=b.free_at_start, outside_torch=b.non_torch_bytes)
    assert b.activation_bytes == usable - 1024**3 <= int(total * cfg.gpu_utilization) - 1024**3 - cfg.headroom_bytes


def test_setup_reads_free_memory_and_device_memory_caps_the_allocator(tmp_path) -> None:  # noqa: ANN001
    from rewardstack.config import from_dict

    cfg = from_dict({"device": "cuda:0", "state_dir": str(tmp_path), "memory": {"device_memory": "4GiB"}})
    mm = MemoryManager(None, device="cuda:0")
    free, total = torch.cuda.mem_get_info(0)
    assert mm.card.startup is not None and abs(mm.card.startup.device_free - free) <= 64 * 1024**2
    b = mm.setup(cfg)
    assert b.total_bytes == 4 * 1024**3 and b.activation_bytes <= int(4 * 1024**3 * cfg.gpu_utilization)
    # The hard cap: an allocation past the 4 GiB card fails even though the real card has room.
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(5 * 1024**3, dtype=torch.uint8, device="cuda:0")
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_measure_reads_the_allocator_peak() -> None:
    mm = MemoryManager(None, device="cuda:0")
    assert mm.tracker is None
    peak = mm.measure(lambda: torch.ones(1024, 1024, device="cuda:0").sum())
    assert 4 * 1024**2 <= peak < 64 * 1024**2


def test_empty_cache_only_on_fragmentation() -> None:
    # Make 256 MiB of reserved-but-unallocated memory, then ask with thresholds on either side of it.
    torch.cuda.empty_cache()
    blocks = [torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda:0") for _ in range(4)]
    del blocks
    stats = torch.cuda.memory_stats(0)
    slack = stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
    assert slack >= 256 * 1024**2
    assert maybe_empty_cache("cuda:0", threshold=slack + 1, split_threshold=1 << 40) is None
    emptied = maybe_empty_cache("cuda:0", threshold=slack // 2, split_threshold=1 << 40)
    assert emptied is not None and "reserved-allocated" in emptied
    after = torch.cuda.memory_stats(0)
    assert after["reserved_bytes.all.current"] - after["allocated_bytes.all.current"] < slack // 2


def test_stack_on_cuda_plans_batches_that_do_not_oom(standins, tmp_path) -> None:  # noqa: ANN001
    # A 1 GiB card: the allocator is capped there (set_per_process_memory_fraction), so a plan
    # that does not fit raises a real CUDA OOM, which the guard records.
    cfg = standin_config(standins, tmp_path / "state", device="cuda:0", memory={"device_memory": "1GiB"})
    try:
        stack = RewardStack(cfg, load_state=False)
        _score_heavy_tailed(stack)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def _score_heavy_tailed(stack: RewardStack) -> None:
    assert all(next(m.parameters()).device.type == "cuda" for s in stack.scorers.values() for m in s.modules())
    for step in heavy_tailed_steps(n_steps=3, n_completions=20):
        res = stack.score_step(step, save=False)
        assert all(math.isfinite(r) for r in res.rewards)
    real = [r for r in stack.memory.oom_log if not r.injected]
    assert real == [], [(r.model, r.batch, r.length, r.message) for r in real]
