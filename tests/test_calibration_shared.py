"""The calibration cache is keyed by what was measured, not by the config's path (issue 34 #5).

`make-standins` into a second folder once profiled every model anew (about 11 s quiet, 402 s
loaded) right after the demo had calibrated the same stand-ins: the key held the checkpoints'
absolute paths and the cache lived in each config's own folder of the home. The same checkpoints
(by content), scorer settings, dtype, profile, device and versions now share one entry, wherever
the config and the checkpoint folders are.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rewardstack import _paths as paths
from rewardstack.config import load_config
from rewardstack.stack import RewardStack
from tests.soak.tiny import make_tiny_standins


def test_the_same_standins_built_in_two_folders_are_profiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))  # an empty home: nothing calibrated yet
    first_config = make_tiny_standins(tmp_path / "a")
    second_config = make_tiny_standins(tmp_path / "b")
    first = RewardStack(load_config(first_config), load_state=False)
    assert len(first.memory.profiled) >= 5, first.memory.profiled
    second = RewardStack(load_config(second_config), load_state=False)
    assert second.memory.profiled == [] and second.memory.calibration.hits == len(first.memory.profiled)
    for name, cost in first.memory.cost_models.items():
        assert second.memory.cost_models[name].to_dict() == cost.to_dict(), name
    # What was measured still decides: another max_length for one model is profiled again, alone.
    text = second_config.read_text().replace('[models.nsfw_filter]\n', '[models.nsfw_filter]\nmax_length = 256\n', 1)
    second_config.write_text(text)
    third = RewardStack(load_config(second_config), load_state=False)
    assert third.memory.profiled == ["nsfw_filter"]
