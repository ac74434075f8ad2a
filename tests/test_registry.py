"""The model registry is the one place a model is declared: no library module spells a model's event
name, and config defaults, `config --explain`, the scorer lookup and the simulation read it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rewardstack import config, _models as models

PACKAGE = Path(models.__file__).parent
NAMES = re.compile(r"\b(" + "|".join(models.ALL_MODELS) + r")\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a bare string statement: documentation)."""
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def literal_names(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal in `path` that contains a model's event name (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and NAMES.search(n.value)]


def test_no_model_event_name_outside_the_registry() -> None:
    found = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py"))
             if p != Path(models.__file__) and (hits := literal_names(p))}
    assert found == {}


def test_the_scan_sees_a_name_spelled_out(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""Docs may name rlhf_reward_model."""\nX = "relevance_filter[1]"\nY = f"{1}nsfw_filter"\n')
    assert [line for line, _ in literal_names(f)] == [2, 3]


def test_config_defaults_and_explain_read_the_registry() -> None:
    assert config.ALL_MODELS == tuple(m.name for m in models.MODELS)
    cfg = config.default_config()
    for m in models.MODELS:
        assert config.DEFAULTS[m.name] == dict(m.defaults)
        mc = cfg.models[m.name]
        assert mc.dtype == m.defaults.get("dtype", "float32") and mc.is_reward == m.is_reward
        assert (mc.path or None) == m.defaults.get("path") and mc.paths == list(m.defaults.get("paths", []))
    from rewardstack import _explain as explain

    text = explain.explain()
    assert all(f"[models.{m.name}]: defaults" in text for m in models.MODELS)


def test_scorer_lookup_and_simulation_read_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from rewardstack._planning import simulate
    from rewardstack._scorers import build_scorer

    runs = {r for m in models.MODELS if m.simulated is not None for r in m.runs()}
    assert set(simulate.SCORERS) == runs
    calls = []
    monkeypatch.setitem(models.BY_NAME, "nsfw_filter", dataclasses.replace(
        models.NSFW, builder="rewardstack._models:spec"))  # any importable function: the lookup must use it
    cfg = config.default_config().models["nsfw_filter"]
    assert build_scorer.__module__ == "rewardstack._scorers"
    with pytest.raises(TypeError):  # spec() takes one argument: the lookup called the registry's builder
        calls.append(build_scorer(cfg, None))  # type: ignore[arg-type]
