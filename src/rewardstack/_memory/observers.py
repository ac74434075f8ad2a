"""What the memory layer tells its subscribers: runs, batches, OOMs and placement moves.

The memory layer knows nothing of who listens (telemetry, replay, a benchmark): a subscriber
derives from `MemoryObserver`, overrides the hooks it needs and is added with
`MemoryManager.subscribe`. Hooks run inside the scoring loop and must never raise into it.

- `run(name, lengths)`: a context manager around one `MemoryManager.run` call (placement, the
  shared prefix, every batch): replay's per-model peak.
- `batch(name, lengths, forward, cost, on_host, prefix=, completions=)`: returns the forward function
  to run for each batch the guard runs (split halves and CPU fallbacks included), e.g. `forward`
  timed and measured: the telemetry's call records. `completions` names each input by the step's
  completion index (the scorer's own numbering skips and merges inputs), None for the prompt.
- `oom(record)`: an out-of-memory error the guard handled (`OomRecord`, with what it did next).
- `moved(move)`: placement moved a model's weights onto the device or off it (`PlacementMove`).
- `profiled(record)`: a profile pass set ran (`ProfileRecord`): at load, or asked for mid-run by a
  budget (DPO's smaller logits chunk), with how long it took and whether its time cap stopped it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._memory.costmodel import CostModel
    from rewardstack._memory.guard import OomRecord

Forward = Callable[[list[int]], Sequence[Any]]


@dataclass
class PlacementMove:
    """One model's weights moved by placement."""

    model: str
    direction: str
    """`in` (swapped onto the device) or `out` (evicted for another)."""
    bytes: int
    seconds: float | None
    """Wall time of the swap that moved it in (None for an eviction, timed with its swap-in)."""
    time: float
    """When the swap began (seconds since the epoch)."""


@dataclass
class ProfileRecord:
    """One profile (a grid of dummy passes fitting a cost model) that ran, cache hits excepted."""

    name: str
    """The calibration's name, e.g. `dpo_reward_model[chunk=64]`."""
    model: str
    """The model it profiles (the name before any `[setting]`)."""
    time: float
    """When it began (seconds since the epoch)."""
    seconds: float
    shapes: int
    """(batch, length) shapes it meant to measure."""
    measured: int
    """Shapes it measured before it ended (fewer than `shapes` when capped)."""
    capped: bool
    """Stopped by its time cap: no cost model came of it and the setting is not used."""
    limit_s: float | None
    """Its time cap (None: none, a load-time profile)."""


class MemoryObserver:
    """A subscriber of the memory layer; every hook does nothing unless overridden."""

    def run(self, name: str, lengths: Sequence[int]) -> AbstractContextManager[Any]:
        """Context around one `MemoryManager.run` call of model run `name`."""
        return nullcontext()

    def batch(self, name: str, lengths: Sequence[int], forward: Forward, cost: "CostModel",
              on_host: bool, prefix: int = 0, completions: Sequence[int | None] | None = None) -> Forward:
        """The forward function to run each batch of this run with (default: `forward` as is).

        `prefix`: the inputs' shared prefix tokens, run before the batches (the prediction of a
        batch is `cost.predict(B, L, prefix)`). `completions`: input j is the step's completion
        `completions[j]` (None: the prompt); None when the caller did not say."""
        return forward

    def oom(self, record: "OomRecord") -> None:
        """An OOM the guard handled."""

    def moved(self, move: PlacementMove) -> None:
        """A placement move."""

    def profiled(self, record: ProfileRecord) -> None:
        """A profile ran (at load, or mid-run for a setting the budget asked for)."""
