"""Replaying the published exports as they store numbers (every number a double, NaN where missing),
and replay's exit codes: 0 all read, 2 records skipped, 1 (an error saying why) when no step was read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest

from rewardstack.cli import main
from rewardstack._replay import readers
from rewardstack._replay.readers import detect, read_run

from replay_fixtures import EQUIVALENT_V10, PASSES, event, loguru_line, parquet_v10, parquet_v11, write_rotated_log

# What `score` and `replay` may differ in: the time a step took and the exactly-once hash.
UNTIMED = ("step_length", "step_hash")


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cpu"\nstate_dir = "st"\n')
    return cfg


def _events(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if k not in UNTIMED} for x in path.read_text().splitlines()]


def test_v10_export_with_float_numbers_replays_every_step_as_score_does(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    path = parquet_v10(tmp_path / "run.parquet", exported=True)
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    assert str(schema.field("block").type) == "double" and str(schema.field("followup_uids").type.value_type) == "double"
    run = read_run([path])
    assert run.errors == [] and len(run.steps) == 4
    steps = [rs.step for rs in run.steps]
    assert [s.block for s in steps] == [77, 77, 78, 78] and all(type(s.block) is int for s in steps)
    assert steps[0].uids == [1, 2, 3] and all(type(u) is int for s in steps for u in s.uids or [])
    assert steps[0].gating_loss == 0.2 and steps[2].gating_loss is None  # NaN: the export's missing number

    rc = main(["replay", str(path), "--config", str(_config(tmp_path)), "--run-dir", str(tmp_path / "rd"), "--no-reference"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "read 4 steps" in err and "0 record(s) skipped" in err
    steps_file = tmp_path / "steps.jsonl"
    steps_file.write_text("".join(json.dumps(s) + "\n" for s in EQUIVALENT_V10))
    assert main(["score", "--config", str(_config(tmp_path)), "--input", str(steps_file), "--output", str(tmp_path / "ev")]) == 0
    replayed, scored = _events(tmp_path / "rd" / "events.jsonl"), _events(tmp_path / "ev")
    assert replayed == scored
    # Equal as JSON could hide 77.0 == 77: the event holds integers, as the steps do.
    assert [type(e["block"]) for e in replayed] == [int] * 4 and all(type(u) is int for e in replayed for u in e["uids"])


def test_v11_export_with_float_numbers_reads_as_the_log(tmp_path: Path) -> None:
    log_steps = [rs.step for rs in read_run([write_rotated_log(tmp_path / "run")]).steps]
    path = parquet_v11(tmp_path / "run-v11.parquet", exported=True)
    assert detect(path) == readers.PARQUET_V11
    run = read_run([path])
    assert run.errors == []
    assert [rs.step for rs in run.steps] == log_steps
    assert all(type(rs.step.block) is int and all(type(u) is int for u in rs.step.uids or []) for rs in run.steps)
    assert math.isnan(run.steps[0].logged["rlhf_reward_model"][1])


def _v10_blocks(path: Path, blocks: list[float]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet_v10(path, exported=True)
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("block"), "block", pa.array(blocks)), path)
    return path


def _v11_blocks(path: Path, blocks: list[float]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet_v11(path, exported=True)
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("block"), "block", pa.array(blocks)), path)
    return path


def _loguru_blocks(path: Path, blocks: list[float]) -> Path:
    path.write_text("\n".join(loguru_line({**event(p, 0), "block": b}, 1.0 + i) for i, (p, b) in enumerate(zip(PASSES, blocks))) + "\n")
    return path


LAYOUTS: dict[str, tuple[Callable[[Path, list[float]], Path], int]] = {
    "parquet-v1.0": (_v10_blocks, 2), "parquet-v1.1": (_v11_blocks, len(PASSES)), "loguru": (_loguru_blocks, len(PASSES)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_whose_every_record_is_skipped_is_an_error_saying_why(layout: str, tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    write, records = LAYOUTS[layout]
    path = write(tmp_path / "run.log", [1000000.5] * records)  # no whole block number: nothing to convert it to
    rc = main(["replay", str(path), "--config", str(_config(tmp_path)), "--run-dir", str(tmp_path / "rd"), "--no-reference"])
    err = capsys.readouterr().err
    assert rc == 1, err
    line = [x for x in err.splitlines() if x.startswith("rewardstack: error:")]
    assert len(line) == 1 and "no step" in line[0] and f"{records} record(s)" in line[0], err
    assert "'block'" in line[0] and "1000000.5" in line[0], line  # the reason, from the first record
    assert not (tmp_path / "rd" / "events.jsonl").exists()  # no empty output passed off as a replay


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_with_a_skipped_record_exits_2_and_names_it(layout: str, tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    write, records = LAYOUTS[layout]
    path = write(tmp_path / "run.log", [7.5] + [1000000.0] * (records - 1))
    rc = main(["replay", str(path), "--config", str(_config(tmp_path)), "--no-reference"])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    want = (records - 1) * 2 if layout == "parquet-v1.0" else records - 1  # a v1.0 row is two steps
    assert f"read {want} steps" in captured.err and "1 record(s) skipped" in captured.err
    skipped = [x for x in captured.out.splitlines() if "skipped:" in x]
    assert len(skipped) == 1 and "'block'" in skipped[0] and "7.5" in skipped[0], captured.out


def test_a_log_with_no_step_record_is_an_error_saying_why(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "completions.log"
    path.write_text(loguru_line({}, 1.0, level="INFO", message="starting") + "\n")
    assert main(["replay", str(path), "--config", str(_config(tmp_path)), "--no-reference"]) == 1
    err = capsys.readouterr().err
    assert "rewardstack: error:" in err and "no step" in err and "EVENTS" in err, err
