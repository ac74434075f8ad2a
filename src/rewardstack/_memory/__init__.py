"""The memory layer: budget, cost model, planner, OOM guard, placement, device, calibration.

Scorers call `MemoryManager.run` with their inputs' token lengths and a forward function; the
manager plans batches that fit the budget, runs each under the OOM guard and returns one outcome per
input. Everything here runs on CPU against a simulated budget, so it is tested without CUDA.

- `budget`: how many bytes the passes may use, sized on the card (`Budget`, `Card`).
- `costmodel`: a pass's predicted peak from its shape, fitted to a profile (`CostModel`, `profile`),
  and the planner: token-budget batching against it (`plan_batches`).
- `guard`: the OOM guard: split, retry, fall back, never drop an input (`run_guarded`, `Outcome`).
- `placement`: which models stay on the device, run on CPU or swap in (`Placement`).
- `device`: the CUDA counters and the CPU tensor-bytes tracker, snapshots, peak windows, allocator.
- `calibration`: the load-time profiles and the cache that keeps their fits (`Profile`).
- `manager`: the `MemoryManager` that composes them, and what it tells subscribers (`MemoryObserver`).
"""

from rewardstack._memory.calibration import Profile
from rewardstack._memory.costmodel import CostModel
from rewardstack._memory.device import TensorBytesTracker, configure_allocator, maybe_empty_cache
from rewardstack._memory.manager import MemoryManager, MemoryObserver
from rewardstack._memory.placement import Placement

__all__ = [
    "CostModel",
    "MemoryManager",
    "MemoryObserver",
    "Placement",
    "Profile",
    "TensorBytesTracker",
    "configure_allocator",
    "maybe_empty_cache",
]
