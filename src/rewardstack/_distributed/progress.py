"""The progress board of a rescore: a tiny Ray actor that keeps each run's attempt and latest step count.

Kept in its own module with no heavy imports, so the actor's process starts in about a second,
well before the first run reports.
"""

from __future__ import annotations

from typing import Any


class RescoreProgress:
    """Latest (attempt, steps, completions, worker) of every run started in one rescore."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}

    def start(self, run_id: str, worker: dict[str, Any]) -> int:
        """Record that `worker` starts `run_id` from scratch: which attempt this is (1 the first time)."""
        attempt = self.runs.get(run_id, {}).get("attempt", 0) + 1
        self.runs[run_id] = {"attempt": attempt, "steps": 0, "completions": 0, "worker": worker}
        return attempt

    def report(self, run_id: str, attempt: int, steps: int, completions: int) -> None:
        """Record that `run_id`'s attempt `attempt` has scored `steps` steps so far (a late report of
        an attempt whose worker died is ignored)."""
        if self.runs[run_id]["attempt"] == attempt:
            self.runs[run_id].update(steps=steps, completions=completions)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every started run's latest report."""
        return {k: dict(v) for k, v in self.runs.items()}
