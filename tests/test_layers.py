"""The import layers of docs/CONTRACT.md hold: `lint-imports` (import-linter) passes, and a layer
broken on purpose is reported (the contract can fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

pytest.importorskip("importlinter")


def lint(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter over the package under `src` with the contracts of `config`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--config", str(config), "--no-cache"], cwd=src.parent,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_are_kept() -> None:
    out = lint(SRC, ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_the_contracts_have_no_ignored_imports() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert {c["type"] for c in contracts} == {"layers", "forbidden"}
    assert not any("ignore_imports" in c for c in contracts)


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("memory/budget.py", "from rewardstack.scorers import base as _upward\n", "imports only from below BROKEN"),
    ("runner.py", "from rewardstack.cli import main as _cli\n", "nothing imports the command line BROKEN"),
])
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(SRC / "rewardstack", src / "rewardstack", ignore=shutil.ignore_patterns("__pycache__"))
    with open(src / "rewardstack" / module, "a", encoding="utf-8") as f:
        f.write(line)
    out = lint(src, ROOT / "pyproject.toml")
    assert out.returncode != 0
    assert broken in out.stdout, out.stdout
