"""Ordinary mistakes at the command line: one line, exit code 1, no traceback, found before models load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewardstack import stack as stack_mod
from rewardstack.cli import main
from rewardstack._fileio import read_steps
from rewardstack.errors import InputError


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "stack.toml"
    p.write_text('device = "cpu"\nstate_dir = "state"\n')
    return p


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Any RewardStack built (models loaded) is recorded; a pre-flight check must come first."""
    built: list[str] = []

    def refuse(self, *a, **k) -> None:  # noqa: ANN001, ANN002, ANN003
        built.append("stack")
        raise AssertionError("the stack was built: models loaded before the input was checked")

    monkeypatch.setattr(stack_mod.RewardStack, "__init__", refuse)
    return built


@pytest.mark.parametrize("flag", ["--input", "--output", "--run-dir"])
def test_bad_paths_found_before_any_model_loads(tmp_path: Path, flag: str, no_stack: list[str],
                                                 capsys: pytest.CaptureFixture) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"name": "augment", "prompt": "p", "completions": ["a"]}) + "\n")
    (tmp_path / "afile").write_text("x")
    paths = {"--input": str(steps), "--output": str(tmp_path / "events.jsonl"), "--run-dir": str(tmp_path / "run")}
    paths[flag] = {"--input": str(tmp_path / "nope.jsonl"), "--output": str(tmp_path / "no" / "such" / "e.jsonl"),
                   "--run-dir": str(tmp_path / "afile")}[flag]
    argv = ["score", "--config", str(_config(tmp_path))] + [x for k, v in paths.items() for x in (k, v)]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and no_stack == []
    assert len(err) == 1 and err[0].startswith("rewardstack: error: ") and flag in err[0]
    assert "Traceback" not in "\n".join(err)


def test_missing_config_is_one_line(tmp_path: Path, no_stack: list[str], capsys: pytest.CaptureFixture) -> None:
    steps = tmp_path / "s.jsonl"
    steps.write_text("")
    rc = main(["score", "--config", str(tmp_path / "nope.toml"), "--input", str(steps), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "nope.toml" in err[0] and no_stack == []


def test_report_of_a_missing_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["report", str(tmp_path / "nonexistent")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "nonexistent" in err[0] and "no such folder" in err[0]


def test_verbose_adds_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["-v", "report", str(tmp_path / "nonexistent")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and err.strip().splitlines()[-1].startswith("rewardstack: error: ")


def test_a_file_error_inside_a_command_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # report of a folder holding a timeline that is itself a folder: an OSError deep inside
    run = tmp_path / "run"
    (run / "timeline.jsonl").mkdir(parents=True)
    rc = main(["report", str(run)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("rewardstack: error: ")


@pytest.mark.parametrize("text, column", [
    ('{"name": "a", "prompt": "p"\n', 28),   # unclosed object: the end of this line, not column 1 of the next
    ('{"name": "a", "prompt": p}\n', 25),    # a bare word: where it starts
    ('{not json\n', 2),
])
def test_json_error_column_is_the_errors(text: str, column: int) -> None:
    [(number, err)] = list(read_steps([text]))  # type: ignore[arg-type]
    assert isinstance(err, InputError) and number == 1
    assert f"at column {column})" in str(err)


def test_replay_reader_names_the_errors_column(tmp_path: Path) -> None:
    from rewardstack._replay.readers import read_run

    p = tmp_path / "steps.jsonl"
    good = '{"name": "augment", "prompt": "p", "completions": ["a"]}'
    bad = good[:-1]  # unclosed: the error is one past its last character
    p.write_bytes((good + "\r\n" + bad + "\r\n").encode())
    run = read_run([p])
    assert any(f"line 2: not valid JSON" in e and f"at column {len(bad) + 1})" in e for e in run.errors), run.errors
