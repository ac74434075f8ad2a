"""The memory layer: budget, tensor-bytes tracking, cost models, batch planning, OOM guard, placement.

Scorers call `MemoryManager.run` with their inputs' token lengths and a forward function; the
manager plans batches that fit the budget, runs each under the OOM guard and returns one outcome per
input. Everything here runs on CPU against a simulated budget, so it is tested without CUDA.
"""

from rewardstack.memory.costmodel import CostModel
from rewardstack.memory.manager import MemoryManager, Outcome, OomRecord
from rewardstack.memory.planner import plan_batches
from rewardstack.memory.tracker import TensorBytesTracker, simulated_oom

__all__ = [
    "CostModel",
    "MemoryManager",
    "OomRecord",
    "Outcome",
    "TensorBytesTracker",
    "plan_batches",
    "simulated_oom",
]
