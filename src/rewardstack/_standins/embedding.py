"""Stand-ins of the embedding family: copies of the packaged real MiniLM sentence encoder (`scorers/embedding.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rewardstack._models import RELEVANCE
from rewardstack._standins.tokenizer import minilm_path


def _copy_minilm(dest: Path) -> None:
    if (dest / "config.json").exists():
        return
    src = minilm_path()

    def link_or_copy(s: str, d: str) -> Any:
        try:  # a hard link saves 90 MB per copy when source and destination share a filesystem
            return Path(d).hardlink_to(s)
        except OSError:
            return shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link_or_copy, dirs_exist_ok=True)


def make_relevance_standin(folder: Path) -> dict[str, Any]:
    """Two MiniLM encoders: `folder/bert` (model 1) and `folder/mpnet` (model 2, shared with diversity)."""
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("bert", "mpnet"):
        _copy_minilm(folder / sub)
    return {"paths": [f"{folder.name}/bert", f"{folder.name}/mpnet"], "dtype": "float32"}


def make_diversity_standin(folder: Path) -> dict[str, Any]:
    """The relevance stand-in's model 2 if it sits beside `folder` (shared checkpoint), else a copy."""
    relevance = folder.parent / RELEVANCE.name
    if relevance.exists():  # made by make_relevance_standin: share its model 2
        _copy_minilm(relevance / "mpnet")
        return {"path": f"{RELEVANCE.name}/mpnet", "dtype": "float32"}
    _copy_minilm(folder)
    return {"path": folder.name, "dtype": "float32"}
