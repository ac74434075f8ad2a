"""The trainer routes' model calls in the telemetry: never held for a validator step.

A `rewards.<name>` model is scored by the trainer routes only, between validator steps. Its call
records must not wait in the monitor for the next step's end (a trainer-only service never has
one: the records would pile up in memory for as long as it runs, and a validator step scored
later would be charged with them); they reach the run directory in chunks with no step.
"""

from __future__ import annotations

from pathlib import Path

from rewardstack._memory.costmodel import CostModel
from rewardstack._telemetry.monitor import LOOSE_CHUNK, Monitor
from rewardstack._telemetry.rundir import RunDir, read_timeline


def _calls(mon: Monitor, model: str, n: int) -> None:
    observed = mon.batch(model, [8, 12], lambda idx: [0.0 for _ in idx], CostModel())
    for _ in range(n):
        observed([0, 1])


def test_trainer_calls_reach_the_run_directory_without_a_step(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    mon = Monitor(run_dir=run)
    _calls(mon, "rewards.oa", 2 * LOOSE_CHUNK)
    _calls(mon, "rlhf_reward_model", 3)  # a validator model's calls wait for their step
    written = [r for r in read_timeline(tmp_path / "run") if r["type"] == "call"]
    assert len(written) == 2 * LOOSE_CHUNK, len(written)  # before any step ends, before close
    assert all(r["model"] == "rewards.oa" and r["step"] is None for r in written)
    _calls(mon, "rewards.oa", 5)
    mon.close()
    after = [r for r in read_timeline(tmp_path / "run") if r["type"] == "call"]
    assert sum(r["model"] == "rewards.oa" for r in after) == 2 * LOOSE_CHUNK + 5  # the rest at close
    assert sum(r["model"] == "rlhf_reward_model" for r in after) == 3


def test_close_writes_what_no_step_ended_calls_and_profiles_alike(tmp_path: Path) -> None:
    from rewardstack._memory.calibration import ProfileRecord

    mon = Monitor(run_dir=RunDir(tmp_path / "run"))
    _calls(mon, "rlhf_reward_model", 2)  # a validator step's passes; the step never ends
    mon.profiled(ProfileRecord("dpo_reward_model[chunk=64]", "dpo_reward_model", 1.0, 0.5, 6))
    mon.close()
    records = list(read_timeline(tmp_path / "run"))
    calls = [r for r in records if r["type"] == "call"]
    profiles = [r for r in records if r["type"] == "profiling"]
    assert len(calls) == 2 and all(r["step"] is None for r in calls)
    assert [(p["name"], p["shapes"], p["step"]) for p in profiles] == [("dpo_reward_model[chunk=64]", 6, None)]
