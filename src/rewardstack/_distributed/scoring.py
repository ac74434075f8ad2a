"""Scoring one whole run from fresh state with a stack that stays loaded (no Ray here).

A `RunScorer` loads the models once and scores run after run, each from fresh state: the stack's
stateless part (`RewardStack.forward`) runs the forward passes, and a new stateful part
(`RewardState`, normalizers, blacklist, diversity history) is made for every run, so nothing of one
run leaks into the next. Each Ray worker of `rescore` holds one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from rewardstack.config import StackConfig
from rewardstack._distributed.output import rows_from_event
from rewardstack._distributed.runs import Run, read_run
from rewardstack.stack import RewardStack

ProgressFn = Callable[[int, int], None]
"""Called after each step with (steps done, completions done) of the run in progress."""


@dataclass
class RunScores:
    """A scored run: its table rows and what to record about it."""

    rows: list[dict[str, Any]]
    steps: int
    completions: int
    bad_records: list[str]
    seconds: float


def worker_config(config: StackConfig, gpus_per_worker: float) -> StackConfig:
    """The config a Ray worker (rescore actor, Serve replica) runs: its device follows its GPUs.

    With no GPU reserved the stack runs on CPU (a worker must not use a card it did not reserve);
    with a share of a card (G < 1, several workers per card) the budget shrinks to that share.
    """
    if gpus_per_worker <= 0:
        return replace(config, device="cpu")
    device = config.device if config.device.startswith("cuda") else "cuda"
    share = min(1.0, gpus_per_worker)
    return replace(config, device=device, gpu_utilization=config.gpu_utilization * share)


class RunScorer:
    """One loaded stack that scores whole runs, each from fresh state."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # load_state=False: a rescore never reads or writes the validator's state directory.
        self.stack = RewardStack(config, load_state=False)

    def _fresh(self) -> Callable[[Any], dict[str, Any]]:
        """A scoring function over a new, empty state: step -> event (the stack's two parts)."""
        state = self.stack.new_state()
        return lambda step: state.apply(self.stack.forward(step)).event

    def score_run(self, run: Run, progress: ProgressFn | None = None) -> RunScores:
        """Every step of `run` in order from fresh state; bad records are skipped and listed."""
        started = time.time()
        read = read_run(run)
        score = self._fresh()
        rows: list[dict[str, Any]] = []
        completions = 0
        for done, (index, step) in enumerate(read.steps, start=1):
            event = score(step)
            rows += rows_from_event(index, event)
            completions += len(step.completions)
            if progress is not None:
                progress(done, completions)
        return RunScores(rows, len(read.steps), completions, read.bad, time.time() - started)


def worker_identity() -> dict[str, Any]:
    """Who is scoring (for progress and the manifest)."""
    return {"pid": os.getpid(), "host": os.uname().nodename}
