"""The memory layer: budget, tensor-bytes tracking, cost models, batch planning, OOM guard, placement.

Scorers call `MemoryManager.run` with their inputs' token lengths and a forward function; the
manager plans batches that fit the budget, runs each under the OOM guard and returns one outcome per
input. Everything here runs on CPU against a simulated budget, so it is tested without CUDA.
"""

from rewardstack._memory.allocator import configure_allocator, maybe_empty_cache
from rewardstack._memory.budget import Budget, compute_budget, resolve_budget
from rewardstack._memory.calibrating import Profile
from rewardstack._memory.costmodel import CostModel
from rewardstack._memory.guard import FaultInjector, InjectedOOM
from rewardstack._memory.guard import OomRecord, Outcome
from rewardstack._memory.manager import MemoryManager
from rewardstack._memory.placement import Decision, Placement
from rewardstack._memory.planner import plan_batches
from rewardstack._memory.tracker import TensorBytesTracker, simulated_oom

__all__ = [
    "Budget",
    "CostModel",
    "Decision",
    "FaultInjector",
    "InjectedOOM",
    "Placement",
    "Profile",
    "compute_budget",
    "configure_allocator",
    "maybe_empty_cache",
    "resolve_budget",
    "MemoryManager",
    "OomRecord",
    "Outcome",
    "TensorBytesTracker",
    "plan_batches",
    "simulated_oom",
]
