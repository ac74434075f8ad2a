"""Readers of run logs: loguru (rotated, compressed, bare NaN), parquet v1.0/v1.1, rewardstack JSONL."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rewardstack.cli import main
from rewardstack._replay import readers
from rewardstack._replay.readers import LogFormatError, detect, read_run
from rewardstack._replay.replay import replay
from rewardstack.stack import RewardStack

from replay_fixtures import EQUIVALENT_STEPS, EXPECTED_BASES, PASSES, parquet_v10, parquet_v11, write_rotated_log


def test_loguru_folder_rotated_compressed_in_time_order(tmp_path: Path) -> None:
    folder = write_rotated_log(tmp_path / "run")
    import gzip

    rotated = gzip.decompress((folder / "completions.2023-07-20_10-00-30_000002.log.gz").read_bytes()).decode()
    assert "NaN]" in rotated  # written bare, as the validator's json did
    run = read_run([folder])
    assert [k for _, k in run.files] == [readers.LOGURU] * 3
    assert [p.name for p, _ in run.files][-1] == "completions.log"
    assert run.errors == []
    steps = [rs.step for rs in run.steps]
    assert [s.name for s in steps] == [p["name"] for p in PASSES]  # the INFO line is not a step
    assert [s.base_prompt for s in steps] == EXPECTED_BASES
    assert [s.logged_best for s in steps] == [p["best"] for p in PASSES]
    assert [s.new_forward_pass for s in steps] == [True, None, None, None, None, True]
    # Empty completions: NaN logged -> failed; finite logged -> a real empty answer.
    assert steps[0].completions[1] is None
    assert steps[1].completions[2] == ""
    assert steps[3].completions[3] is None
    rs = run.steps[0]
    assert set(rs.logged) == {"rlhf_reward_model", "blacklist_filter"}  # dahoas logged zeros: it was off
    assert rs.logged["rlhf_reward_model"][0] == 0.5 and math.isnan(rs.logged["rlhf_reward_model"][1])
    assert rs.step.uids == [10, 11, 12, 13] and rs.step.block == 1000


def test_replay_of_completions_log_equals_scoring_the_equivalent_steps(tmp_path: Path, fake_config) -> None:  # noqa: ANN001
    folder = write_rotated_log(tmp_path / "run")
    stack = RewardStack(fake_config)
    got = []
    replay(stack, read_run([folder]).steps, reference=False, on_event=got.append)
    steps_file = tmp_path / "steps.jsonl"
    steps_file.write_text("".join(json.dumps(s) + "\n" for s in EQUIVALENT_STEPS))
    (tmp_path / "c.toml").write_text('device = "cpu"\nstate_dir = "st"\n')
    assert main(["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps_file), "--output", str(tmp_path / "ev")]) == 0
    want = [json.loads(x) for x in (tmp_path / "ev").read_text().splitlines()]
    strip = lambda e: {k: v for k, v in json.loads(json.dumps(e, allow_nan=True)).items()  # noqa: E731
                       if k not in ("step_length", "step_hash", "uids", "block", "gating_loss", "completion_times")}
    from rewardstack._fileio import jsonable as _jsonable

    assert [strip(_jsonable(e)) for e in got] == [strip(e) for e in want]
    # The blacklist holds the logged bests of the forward pass, and forgets them at the next augment.
    bl = [e["blacklist_filter"] for e in want]
    assert bl[3][0] == 0.0  # followup0's logged best, offered again in followup1
    assert bl[4][0] == 0.0  # answer0's logged best, offered again in answer1
    assert bl[2][1] == 0.0  # answer0: the base prompt (followup0's best) itself
    assert bl[5][0] == 1.0 and bl[5][3] == 1.0  # a new forward pass: lists reset
    assert bl[0][3] == 0.0  # the stock phrase


def test_parquet_v11_reads_as_the_log(tmp_path: Path) -> None:
    log_steps = [rs.step for rs in read_run([write_rotated_log(tmp_path / "run")]).steps]
    path = parquet_v11(tmp_path / "run-v11.parquet")
    assert detect(path) == readers.PARQUET_V11
    run = read_run([path])
    assert [rs.step for rs in run.steps] == log_steps
    assert math.isnan(run.steps[0].logged["rlhf_reward_model"][1])


def test_parquet_v10_two_steps_per_row(tmp_path: Path) -> None:
    path = parquet_v10(tmp_path / "run-v10.parquet")
    assert detect(path) == readers.PARQUET_V10
    run = read_run([path])
    s = [rs.step for rs in run.steps]
    assert [x.name for x in s] == ["followup", "answer", "followup", "answer"]
    assert s[0].prompt == "Ask about: Describe the water cycle." and s[0].base_prompt == "Describe the water cycle."
    assert s[1].base_prompt == "What drives evaporation?" and s[1].logged_best == "The sun's heat."
    assert s[2].prompt == "Explain tides."  # no followup_prompt: the base prompt is the prompt
    assert [x.new_forward_pass for x in s] == [True, None, True, None]
    # No per-model values in this layout: empty (or blank) means a failed call.
    assert s[0].completions[1] is None and s[3].completions[1] is None
    assert run.steps[0].logged_rewards == [0.4, 0.0, 0.3] and run.steps[0].logged == {}
    assert s[1].uids == [1, 2, 3]


def test_rewardstack_step_and_event_jsonl(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    steps_file = tmp_path / "steps.jsonl"
    steps_file.write_text("".join(json.dumps(s) + "\n" for s in EQUIVALENT_STEPS))
    assert detect(steps_file) == readers.STEPS
    assert [rs.step.base_prompt for rs in read_run([steps_file]).steps] == EXPECTED_BASES
    (tmp_path / "c.toml").write_text('device = "cpu"\nstate_dir = "st"\n')
    main(["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps_file), "--output", str(tmp_path / "ev")])
    assert detect(tmp_path / "ev") == readers.EVENTS
    events = [json.loads(x) for x in (tmp_path / "ev").read_text().splitlines()]
    run = read_run([tmp_path / "ev"])
    got = [rs.step for rs in run.steps]
    # Failed responses come back from the statuses (written as "" in the event).
    assert got[0].completions[1] is None and got[3].completions[3] is None and got[1].completions[2] == ""
    # Base prompts are rebuilt from the events' own bests.
    assert got[1].base_prompt == events[0]["best"] and got[2].base_prompt == events[1]["best"]
    assert run.steps[0].logged["dpo_reward_model"][0] == events[0]["dpo_reward_model"][0]


def test_bad_records_are_reported_and_skipped(tmp_path: Path) -> None:
    folder = write_rotated_log(tmp_path / "run")
    live = folder / "completions.log"
    lines = live.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["record"]["extra"]["completions"] = "not a list"
    live.write_text("\n".join([lines[0], "{torn", json.dumps(bad), '{"text": "x", "record": {"level": {"name": "EVENTS"}, '
                               '"extra": {"name": "answer9", "prompt": "p", "completions": ["a \\ud800"]}}}', lines[1]]) + "\n")
    run = read_run([folder])
    assert len(run.steps) == 6 and len(run.errors) == 3
    assert any("line 2" in e and "not valid JSON" in e for e in run.errors)
    assert any("line 3" in e and "completions" in e for e in run.errors)
    assert any("line 4" in e and "surrogate" in e for e in run.errors)


def test_unknown_file_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "x.log"
    p.write_text("hello\n")
    with pytest.raises(LogFormatError, match="not a run log"):
        read_run([p])
