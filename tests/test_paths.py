"""One home: every default location (state, calibration cache, plan cache, run folders, stand-ins)
lands under $REWARDSTACK_HOME, per config file, and every explicit setting still wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewardstack import _paths as paths
from rewardstack.cli import build_parser, main
from rewardstack.config import load_config
from rewardstack._memory.manager import MemoryManager


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("REWARDSTACK_HOME", str(h))
    monkeypatch.chdir(tmp_path)  # the old defaults (./state, ./soak-runs) would land here
    return h


def _config(folder: Path, text: str = 'device = "cpu"\n') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "stack.toml"
    p.write_text(text)
    return p


def test_defaults_are_per_config_folders_of_the_home(home: Path, tmp_path: Path) -> None:
    a, b = _config(tmp_path / "a"), _config(tmp_path / "b")
    ca, cb = load_config(a), load_config(b)
    # Same file name, different folders: two homes, never one shared state.
    assert Path(ca.state_dir).parent.parent == home and Path(ca.state_dir).name == "state"
    assert Path(ca.state_dir).parent.name.startswith("stack-") and ca.state_dir != cb.state_dir
    assert Path(ca.state_dir) == paths.config_home(a) / "state"
    assert not (tmp_path / "state").exists()
    # The calibration cache is the home's one file: its entries are keyed by checkpoint, not config.
    cal, cal_b = MemoryManager.for_config(ca).calibration, MemoryManager.for_config(cb).calibration
    assert cal is not None and cal_b is not None and cal.path == cal_b.path == home / "calibration" / "cache.json"
    assert paths.new_run_dir(a, "soak").parent == paths.config_home(a) / "runs"
    assert paths.plan_cache() == home / "plan-cache" and paths.standins() == home / "standins"


def test_explicit_settings_win(home: Path, tmp_path: Path) -> None:
    # The stand-ins' stack.toml states state_dir = "state": beside the config, as before.
    c = load_config(_config(tmp_path / "c", 'device = "cpu"\nstate_dir = "state"\n'
                                           '[memory]\ncalibration_file = "fits.json"\n'))
    assert Path(c.state_dir) == (tmp_path / "c" / "state").resolve()
    cal = MemoryManager.for_config(c).calibration
    assert cal is not None and cal.path == (tmp_path / "c" / "fits.json").resolve()
    assert paths.run_dir_for("given", "x.toml", "score") == "given" and paths.run_dir_for(None, "x.toml", "score") is None


def test_score_puts_state_and_a_bare_run_dir_in_the_home(home: Path, tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    config = _config(tmp_path / "cfg")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"name": "augment", "prompt": "p", "completions": ["one", "two"]}) + "\n")
    rc = main(["score", "--config", str(config), "--input", str(steps), "--output", str(tmp_path / "ev.jsonl"),
               "--run-dir"])
    assert rc == 0
    own = paths.config_home(config)
    assert (own / "state" / "state.safetensors").exists()
    runs = list((own / "runs").glob("score-*"))
    assert len(runs) == 1 and (runs[0] / "summary.json").exists()
    assert not (tmp_path / "state").exists() and not (tmp_path / "cfg" / "state").exists()


def test_help_names_the_home() -> None:
    text = build_parser().format_help()
    assert "$REWARDSTACK_HOME" in text and "calibration/cache.json" in text


def test_an_old_state_in_the_working_folder_is_named(home: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.safetensors").write_bytes(b"")
    with caplog.at_level("WARNING", logger="rewardstack.config"):
        load_config(_config(tmp_path / "d"))
    assert "set state_dir" in caplog.text
