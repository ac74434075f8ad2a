"""`rewardstack demo` is repeatable: a second run prints the first run's rewards and best (issue 34 #6).

The demo once loaded and saved the stand-ins' scoring state, so each run continued the last one's
normalizers and diversity history and printed other rewards and another best, saying only
"state saved in ...".
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from rewardstack.cli import main


def _demo_home(standins: Path, home: Path) -> Path:
    """The tiny stand-ins behind a fresh folder (links to the models, its own stack.toml), so the
    demo's state, if it wrote one, would land here and not in the session's shared folder."""
    home.mkdir()
    for entry in standins.iterdir():
        if entry.name == "stack.toml":
            shutil.copy(entry, home / entry.name)
        elif entry.name != "state":
            (home / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return home


def test_a_second_demo_prints_the_same_run(tiny_standins: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = _demo_home(tiny_standins, tmp_path / "demo")
    runs = []
    for _ in range(2):
        assert main(["-q", "demo", "--dir", str(home)]) == 0
        out, err = capsys.readouterr()
        runs.append(re.sub(r"scored in [0-9.]+s", "scored in -s", out))
    assert runs[0] == runs[1]
    assert "fresh state" in err and "nothing is saved" in err, err
    assert not (home / "state").exists()
