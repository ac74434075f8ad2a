"""`rewardstack report` on a run folder whose `score` scored nothing says why, in words.

Walking the README as a new user (2026-12-03): `score --output events.jsonl`, then the report
section's `score --output events.jsonl --run-dir D` resumed after the three steps already in
events.jsonl, scored none, and `report D` printed an empty report without a word why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewardstack.cli import main
from rewardstack.stack import Step


def test_a_run_folder_whose_score_resumed_past_every_step_is_reported_as_such(
        tmp_path: Path, fake_registry: None, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(Step("augment", f"p{k}", ["one answer", "another"]).to_dict()) + "\n"
                             for k in range(2)))
    (tmp_path / "c.toml").write_text('device = "cpu"\nstate_dir = "state"\n')
    args = ["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps), "--output", str(tmp_path / "events.jsonl")]
    assert main(args) == 0
    assert main([*args, "--run-dir", str(tmp_path / "D")]) == 0
    assert "2 already in" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "D")]) == 0
    out = capsys.readouterr().out
    assert "0 steps" in out and "no step was scored in this run folder" in out
    # A run folder whose score did score the steps says nothing of the kind.
    (tmp_path / "c2.toml").write_text('device = "cpu"\nstate_dir = "state2"\n')
    assert main(["score", "--config", str(tmp_path / "c2.toml"), "--input", str(steps), "--output",
                 str(tmp_path / "fresh.jsonl"), "--run-dir", str(tmp_path / "E")]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "E")]) == 0
    out = capsys.readouterr().out
    assert "2 steps" in out and "no step was scored" not in out
