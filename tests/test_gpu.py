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
from rewardstack.memory import MemoryManager, compute_budget, configure_allocator, maybe_empty_cache
from rewardstack.workload import heavy_tailed_steps

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
    b = compute_budget(cfg, "cuda:0", weights=1024**3)
    assert b.source == "device" and b.total_bytes == total
    assert b.activation_bytes == int(total * cfg.gpu_utilization) - 1024**3 - cfg.headroom_bytes


def test_measure_reads_the_allocator_peak() -> None:
    mm = MemoryManager(None, device="cuda:0")
    assert mm.tracker is None
    peak = mm.measure(lambda: torch.ones(1024, 1024, device="cuda:0").sum())
    assert 4 * 1024**2 <= peak < 64 * 1024**2


def test_empty_cache_only_on_fragmentation() -> None:
    d = maybe_empty_cache("cuda:0", threshold=1 << 60)
    assert not d.emptied


def test_stack_on_cuda_scores_within_budget(standins, tmp_path) -> None:  # noqa: ANN001
    cfg = standin_config(standins, tmp_path / "state", device="cuda:0")
    stack = RewardStack(cfg, load_state=False)
    torch.cuda.reset_peak_memory_stats(0)
    base = torch.cuda.memory_allocated(0)
    for step in heavy_tailed_steps(n_steps=3, n_completions=20):
        res = stack.score_step(step, save=False)
        assert all(math.isfinite(r) for r in res.rewards)
    assert stack.memory.budget_bytes is not None
    assert torch.cuda.max_memory_allocated(0) - base <= stack.memory.budget_bytes
