"""Shared fixtures: a stack config whose model-backed scorers are deterministic fakes."""

from __future__ import annotations

import pytest

from rewardstack import config as config_mod
from rewardstack.scorers import REGISTRY


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point every model-backed scorer at `fakes.build` (rule masks stay real)."""
    for name in config_mod.ALL_MODELS:
        if name not in config_mod.RULE_MASKS:
            monkeypatch.setitem(REGISTRY, name, ("fakes:build", None))


@pytest.fixture
def fake_config(tmp_path, fake_registry):  # noqa: ANN001, ANN201
    """A StackConfig on CPU with a temporary state dir and fake model scorers."""
    return config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "state")})
