"""OOM incident records: everything needed to say afterwards why an out-of-memory error happened.

One record per OOM, recovered or not: the step, the model, the batch's shape and token lengths, the
cost model's prediction and the budget, the allocator's figures, and every input of the batch by its
index, length, first 200 characters and sha256 (so the input can be found again in the events
without copying it whole). On CPU the record lists the largest live tensors the tracker saw at the
failing allocation, with the aten op that made each. On CUDA the allocator's allocation history is
recorded with a bounded number of entries (`History`), and at each OOM its snapshot is written
beside the record as a pickle for PyTorch's memory visualizer (pytorch.org/memory_viz, or
`python -m torch.cuda._memory_viz`). rewardstack writes that file for the visualizer and never reads
one.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("rewardstack.telemetry")

HEAD_CHARS = 200


def describe_input(index: int, length: int, completion: int | None, text: str | None) -> dict[str, Any]:
    """One input of a batch: its index in the scorer's call, its completion, tokens, head and hash."""
    d: dict[str, Any] = {"index": index, "length": length, "completion": completion}
    if text is not None:
        d["head"] = text[:HEAD_CHARS]
        d["chars"] = len(text)
        d["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return d


def cuda_allocator_stats(device: torch.device) -> dict[str, int]:  # pragma: no cover - CUDA-only path
    """The allocator counters an OOM is read against (`torch.cuda.memory_stats`)."""
    s = torch.cuda.memory_stats(device)
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "active_bytes.all.current", "inactive_split_bytes.all.current",
            "requested_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_ooms")
    return {k: int(s[k]) for k in keys if k in s}


class History:
    """CUDA allocation history, recorded with at most `max_entries` entries (never unbounded).

    `capture()` takes the allocator's snapshot (segments and the recent alloc/free trace, the OOM
    included) at the moment of an OOM; `writer(snapshot)` gives the function that pickles it for the
    memory visualizer. Off (0 entries) or not on CUDA: nothing is recorded and nothing is written.
    """

    def __init__(self, device: torch.device, max_entries: int) -> None:
        self.device = device
        self.max_entries = max(0, int(max_entries))
        self.on = False
        if self.max_entries and device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - CUDA-only path
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, device=device)
            self.on = True
            log.info("recording CUDA allocation history (at most %d entries)", self.max_entries)

    def capture(self) -> Any | None:
        """The allocator's snapshot now (None when not recording)."""
        if not self.on:
            return None
        try:  # pragma: no cover - CUDA-only path
            return torch.cuda.memory._snapshot(self.device)
        except Exception as e:  # noqa: BLE001 - forensics must never stop scoring
            log.warning("could not take the allocator snapshot: %s", e)
            return None

    @staticmethod
    def writer(snapshot: Any | None) -> Callable[[Path], None] | None:
        """A function that writes `snapshot` as the visualizer's pickle (None for no snapshot)."""
        if snapshot is None:
            return None

        def write(path: Path) -> None:  # pragma: no cover - CUDA-only path
            with open(path, "wb") as f:
                pickle.dump(snapshot, f)  # for torch.cuda._memory_viz; rewardstack never loads it
        return write

    def stop(self) -> None:
        """Stop recording."""
        if self.on:  # pragma: no cover - CUDA-only path
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.on = False
