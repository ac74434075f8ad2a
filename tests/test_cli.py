"""The `rewardstack score` command: events out, bad lines named, good lines kept (fake scorers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewardstack.cli import main


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "stack.toml"
    p.write_text('device = "cpu"\nstate_dir = "state"\n')
    return p


def test_score_writes_events_and_names_bad_lines(tmp_path: Path, fake_registry, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    good = {"name": "augment", "prompt": "p", "completions": ["first one", "second one"], "uids": [3, 4]}
    steps.write_text(
        json.dumps(good) + "\n"
        + "{not json\n"
        + json.dumps({"name": "answer0", "completions": ["x"]}) + "\n"
        + "\n"
        + json.dumps({**good, "name": "followup0"}) + "\n"
    )
    out = tmp_path / "events.jsonl"
    rc = main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "line 2" in err and "not valid JSON" in err
    assert "line 3" in err and "'prompt'" in err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["name"] for e in events] == ["augment", "followup0"]
    assert events[0]["uids"] == [3, 4] and len(events[0]["rewards"]) == 2
    assert (tmp_path / "state" / "state.safetensors").exists()


def test_nan_is_written_as_null(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"name": "augment", "prompt": "p", "completions": ["NAN", None, "ok text"]}) + "\n")
    out = tmp_path / "events.jsonl"
    assert main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out)]) == 0
    text = out.read_text()
    assert "NaN" not in text
    ev = json.loads(text)
    assert ev["dpo_reward_model"][0] is None and ev["dpo_reward_model"][1] is None
    assert ev["statuses"][1] == "failed"


def test_config_error_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[models.dpo_reward_model]\nweight = 0.9\n")
    steps = tmp_path / "s.jsonl"
    steps.write_text("")
    rc = main(["score", "--config", str(bad), "--input", str(steps), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "models.*.weight" in err[0]


def test_lone_surrogate_line_is_reported_and_the_rest_scored(tmp_path: Path, fake_registry, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        '{"name": "followup0", "prompt": "hello", "completions": ["abc \\ud800 def", "xyz"]}\n'
        + json.dumps({"name": "answer0", "prompt": "p", "completions": ["fine answer"]}) + "\n"
    )
    out = tmp_path / "events.jsonl"
    rc = main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out)])
    assert rc == 2 and "completions[0]" in capsys.readouterr().err
    assert [json.loads(x)["name"] for x in out.read_text().splitlines()] == ["answer0"]


def test_save_every_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["score", "--config", "c", "--input", "i", "--output", "o", "--save-every", "0"])
