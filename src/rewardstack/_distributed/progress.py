"""The progress board of a rescore: a tiny Ray actor that keeps each run's latest step count.

Kept in its own module with no heavy imports, so the actor's process starts in about a second,
well before the first run reports.
"""

from __future__ import annotations

from typing import Any


class RescoreProgress:
    """Latest (attempt, steps, completions, worker) of every run in progress, per rescore job."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, dict[str, Any]]] = {}

    def report(self, job: str, run_id: str, attempt: int, steps: int, completions: int,
               worker: dict[str, Any]) -> None:
        """Record that `run_id`'s attempt `attempt` in `job` has scored `steps` steps so far."""
        self.jobs.setdefault(job, {})[run_id] = {"attempt": attempt, "steps": steps, "completions": completions,
                                                 "worker": worker}

    def snapshot(self, job: str) -> dict[str, dict[str, Any]]:
        """Every run's latest report in `job`."""
        return dict(self.jobs.get(job, {}))

    def forget(self, job: str) -> None:
        """Drop a finished job's reports."""
        self.jobs.pop(job, None)
