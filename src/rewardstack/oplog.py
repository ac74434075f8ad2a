"""The lines an operator reads at INFO: what each model loaded, and one line per scored step.

At startup (`log_models`), one line per model: its checkpoint, the revision it was loaded at, its
dtype, the bytes of its weights, where they are, and which attention it runs (where the scorer
chose one). The budget, placement decisions and each cost model's fit are logged by the memory
layer as they are made (`rewardstack.memory`). Per step (`StepLine`), one line: the step's name,
its completions, the time it took, the count of each status and the memory peak above what was
live when it began (the tracker's on CPU, the allocator's on CUDA; on CUDA the telemetry's per-call windows reset that counter, and the peak is
then the one since the last call began).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.stack import RewardStack, StepResult

log = logging.getLogger("rewardstack.stack")


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def weights_bytes(modules: list[torch.nn.Module]) -> int:
    """Bytes of the distinct parameters and buffers of `modules` (a shared tensor counts once)."""
    seen: set[int] = set()
    total = 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def revision_of(path: str | None, configured: str | None, modules: list[torch.nn.Module]) -> str:
    """The revision a model was loaded at: the configured one, else the hub commit transformers
    recorded, else 'local folder' (a path on disk) or 'unpinned'."""
    if configured:
        return configured
    for m in modules:
        commit = getattr(getattr(m, "config", None), "_commit_hash", None)
        if commit:
            return str(commit)
    if path and Path(path).exists():
        return "local folder"
    return "unpinned"


def log_models(stack: "RewardStack") -> None:
    """One INFO line per loaded model: checkpoint, revision, dtype, weights bytes, device."""
    for name, scorer in stack.scorers.items():
        modules = scorer.modules()
        if not modules:
            log.info("model %s: rule-based, no weights", name)
            continue
        cfg = stack.config.models[name]
        params = [p for m in modules for p in m.parameters()]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        where = sorted({str(p.device) for p in params})
        path = cfg.path if cfg.path else ", ".join(cfg.paths)
        attention = scorer.attention_info()
        log.info("model %s: %s at %s, %s, %s of weights on %s%s", name, path,
                 revision_of(cfg.path, cfg.revision, modules), "/".join(dtypes),
                 _mib(weights_bytes(modules)), "+".join(where), f"; {attention}" if attention else "")


class StepLine:
    """Times one step and measures its memory peak; `done(result)` logs the step's line."""

    def __init__(self, stack: "RewardStack", name: str) -> None:
        from rewardstack.telemetry.snapshot import PeakWindow

        self.name = name
        self.window = PeakWindow(stack.device, stack.memory.tracker, watch=True)  # the calls inside count
        self.started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "StepLine":
        self.started = time.perf_counter()
        self.window.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.window.__exit__(*exc)
        self.seconds = time.perf_counter() - self.started

    def done(self, result: "StepResult", sequence: int) -> None:
        counts = Counter(result.statuses)
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(counts.items())) or "no completions"
        log.info("step %d %s: %d completions in %.3fs; %s; memory peak %s", sequence, self.name,
                 len(result.statuses), self.seconds, statuses, _mib(self.window.peak_increase))
