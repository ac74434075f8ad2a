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
    ("_memory/budget.py", "from rewardstack._scorers import base as _upward\n", "imports only from below BROKEN"),
    ("_runner.py", "from rewardstack.cli import main as _cli\n", "nothing imports the command line BROKEN"),
])
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(SRC / "rewardstack", src / "rewardstack", ignore=shutil.ignore_patterns("__pycache__"))
    with open(src / "rewardstack" / module, "a", encoding="utf-8") as f:
        f.write(line)
    out = lint(src, ROOT / "pyproject.toml")
    assert out.returncode != 0
    assert broken in out.stdout, out.stdout


def import_circles(package_dir: Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (strongly connected
    components of the import graph), `TYPE_CHECKING` imports included: a type-only circle is still
    two modules that cannot be read one without the other."""
    import grimp

    sys.path.insert(0, str(package_dir.parent))
    try:
        graph = grimp.build_graph(package_dir.name, exclude_type_checking_imports=False, cache_dir=None)
    finally:
        sys.path.remove(str(package_dir.parent))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert import_circles(SRC / "rewardstack") == []


def test_a_circle_made_on_purpose_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "circles"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circles import b\n")
    (pkg / "b.py").write_text("from circles import a\n")
    (pkg / "c.py").write_text("from circles import a\n")
    assert import_circles(pkg) == [["circles.a", "circles.b"]]
