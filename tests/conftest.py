"""Shared fixtures: a stack config whose model-backed scorers are deterministic fakes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import pytest

from rewardstack import config as config_mod
from rewardstack import models


_HOME: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """One temporary $REWARDSTACK_HOME for the whole session (subprocesses inherit it): no test writes
    the operator's ~/.cache/rewardstack, and stacks built from one config file still share one
    calibration cache across tests, as restarts would. The real checkpoints stay where they were
    fetched ($REWARDSTACK_REAL_CACHE, pinned before the home moves)."""
    from rewardstack.realmodels import CACHE_ENV, default_cache

    os.environ.setdefault(CACHE_ENV, str(default_cache()))
    _HOME["path"] = os.environ["REWARDSTACK_HOME"] = tempfile.mkdtemp(prefix="rewardstack-test-home-")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist (scripts/test.sh runs `-n 2` on CI's two cores) each worker is one
        # core's worth: torch runs one thread, and so do the processes tests start (soak workers,
        # `serve`, Ray's workers inherit the variable). Each worker has its own home (above).
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (scripts/test.sh) a test file runs whole on one worker, so its
    module fixtures are built once; the two Ray files share one group, so only one local Ray
    cluster runs at a time."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("ray" if name.startswith("test_ray_") else name))


def pytest_unconfigure(config: pytest.Config) -> None:
    if "path" in _HOME:
        shutil.rmtree(_HOME.pop("path"), ignore_errors=True)


def use_builder(monkeypatch: pytest.MonkeyPatch, name: str, builder: str) -> None:
    """Build model `name` with `builder` ("module:function") for this test (the registry's entry)."""
    monkeypatch.setitem(models.BY_NAME, name, dataclasses.replace(models.BY_NAME[name], builder=builder, standin=None))


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point every model-backed scorer at `fakes.build` (rule masks stay real)."""
    for name in config_mod.ALL_MODELS:
        if name not in config_mod.RULE_MASKS:
            use_builder(monkeypatch, name, "fakes:build")


@pytest.fixture
def fake_config(tmp_path, fake_registry):  # noqa: ANN001, ANN201
    """A StackConfig on CPU with a temporary state dir and fake model scorers."""
    return config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "state")})


@pytest.fixture(scope="session")
def standins(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The offline stand-in stack, built once per test session; returns its folder."""
    from rewardstack.standins import make_standins

    root = tmp_path_factory.mktemp("standins")
    make_standins(root)
    return root


@pytest.fixture(scope="session")
def tiny_standins(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The tiny stand-in stack (`make-standins --tiny`), built once per test session; returns its folder."""
    from rewardstack.standins import make_tiny_standins

    root = tmp_path_factory.mktemp("tiny_standins")
    make_tiny_standins(root)
    return root


def standin_config(root, state_dir, **top):  # noqa: ANN001, ANN003, ANN201
    """A StackConfig over the stand-ins with every model on (all five reward models weighted).

    Its source is the stand-ins' stack.toml, so every stack built from it shares one calibration
    cache (in the session's $REWARDSTACK_HOME): the session profiles each model once, as a restart would.
    """
    import tomllib

    data = tomllib.loads((root / "stack.toml").read_text())
    data.update(top)
    data["state_dir"] = str(state_dir)
    weights = {"dpo_reward_model": 0.2, "rlhf_reward_model": 0.2, "reciprocate_reward_model": 0.2,
               "dahoas_reward_model": 0.2, "prompt_reward_model": 0.2}
    for name, w in weights.items():
        data["models"][name]["weight"] = w
    return config_mod.from_dict(data, base=root, source=root / "stack.toml")
