"""The lines an operator reads at INFO: what each model loaded, and one line per scored step.

At startup (`log_models`), one line per model: its checkpoint, the revision it was loaded at, its
dtype, the bytes of its weights, where they are, and which attention it runs (where the scorer
chose one). The budget, placement decisions and each cost model's fit are logged by the memory
layer as they are made (`rewardstack._memory`). Per step (`OperatorLog`, a step observer of the
stack), one line: the step's name, its completions, the time it took, the count of each status and
the memory peak above what was live when it began (on CPU a watch window of the tracker: the peak
of the model calls inside the step; on CUDA the allocator's, through a nestable peak window, so the
telemetry's per-call windows inside it do not reset it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch

from rewardstack._memory.budget import weights_bytes
from rewardstack._memory.device import PeakWindow
from rewardstack._stepobservers import ScoringStack, StepObserver
from rewardstack._stepresult import StepResult

log = logging.getLogger("rewardstack.stack")


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def revision_of(path: str | Sequence[str] | None, configured: str | None, modules: list[torch.nn.Module]) -> str:
    """The revision a model was loaded at: the configured one, else the hub commit transformers
    recorded, else 'local folder(s)' when every path is on disk (relevance loads two), else the
    hub's default branch, which `rewardstack download` would lock."""
    if configured:
        return configured
    for m in modules:
        commit = getattr(getattr(m, "config", None), "_commit_hash", None)
        if commit:
            return str(commit)
    given = [path] if isinstance(path, str) else list(path or [])
    if given and all(p and Path(p).exists() for p in given):
        return "local folder" if len(given) == 1 else "local folders"
    return "the hub's default branch (not locked: rewardstack download pins it)"


def log_models(stack: ScoringStack) -> None:
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
                 revision_of(cfg.path or list(cfg.paths), cfg.revision, modules), "/".join(dtypes),
                 _mib(weights_bytes(modules)), "+".join(where), f"; {attention}" if attention else "")


class OperatorLog(StepObserver):
    """The stack's step observer that times each step, measures its memory peak and logs its line.

    Per thread: two threads scoring steps on one stack each get their own window and clock.
    """

    def __init__(self) -> None:
        self._tls = threading.local()

    def step_started(self, stack: ScoringStack, name: str) -> None:
        s = self._tls
        # watch=True: the model calls inside the step enter the tracker themselves, and their peak counts
        s.name, s.window, s.seconds = name, PeakWindow(stack.device, stack.memory.tracker, watch=True), 0.0
        s.started = time.perf_counter()
        s.window.__enter__()

    def step_ended(self, stack: ScoringStack) -> None:
        s = self._tls
        s.window.__exit__(None, None, None)
        s.seconds = time.perf_counter() - s.started

    def step_scored(self, stack: ScoringStack, result: StepResult) -> None:
        s = self._tls
        counts = Counter(result.statuses)
        statuses = ", ".join(f"{st} {n}" for st, n in sorted(counts.items())) or "no completions"
        log.info("step %d %s: %d completions in %.3fs; %s; memory peak %s", stack.steps_scored, s.name,
                 len(result.statuses), s.seconds, statuses, _mib(s.window.peak_increase))
