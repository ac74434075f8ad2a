"""Shared fixtures: a stack config whose model-backed scorers are deterministic fakes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks' support code (`bench.realtexts`) is the tests' too
    sys.path.insert(0, str(ROOT))

from rewardstack import config as config_mod  # noqa: E402
from rewardstack import _models as models  # noqa: E402


_HOME: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """One temporary $REWARDSTACK_HOME for the whole session (subprocesses inherit it): no test writes
    the operator's ~/.cache/rewardstack, and stacks built from one config file still share one
    calibration cache across tests, as restarts would. The real checkpoints stay where they were
    fetched ($REWARDSTACK_REAL_CACHE, pinned before the home moves)."""
    from bench.realmodels import CACHE_ENV, default_cache

    os.environ.setdefault(CACHE_ENV, str(default_cache()))
    _HOME["path"] = os.environ["REWARDSTACK_HOME"] = tempfile.mkdtemp(prefix="rewardstack-test-home-")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist (scripts/test.sh runs `-n 2` on CI's two cores) each worker is one
        # core's worth: torch runs one thread, and so do the processes tests start (soak workers,
        # `serve`, Ray's workers inherit the variable). Each worker has its own home (above).
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"


# The files that take longest (`--durations`, 2026-12-03), handed out first so that neither worker
# is left with a long file at the end; the rest follow in collection order. A file missing here
# only runs later.
LONGEST_FIRST = (
    "test_dpo.py", "test_soak.py", "test_real_dpo.py", "test_stack_memory.py", "test_validator_service.py",
    "test_real_mpnet.py", "test_bench.py", "test_gpu_rehearsal.py", "test_adversarial.py", "test_blocked_attention.py",
    "test_ray_rescore.py", "test_ray_serve.py", "test_ray_trainers.py", "test_plan.py", "test_service_lifecycle.py",
    "test_replay_pathological.py",
    "test_prediction.py",
)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # pytest-xdist's hook (absent without it), before its own
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadfile`) a test file runs whole on one
    worker, so its module fixtures are built once; the two Ray files share one unit, so only one
    local Ray cluster runs at a time; the longest files go out first. (xdist's `loadgroup` marks
    do not reach pytest 9.2's node ids, so the grouping is done here.)"""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist would order files by their number of tests

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if _file_of(nodeid).startswith("test_ray_") else nodeid.split("::", 1)[0]

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the longest files first (`LONGEST_FIRST`): the scheduler hands out files
    in the order the workers collected them (a run in one process keeps the usual order)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected


def pytest_unconfigure(config: pytest.Config) -> None:
    if "path" in _HOME:
        shutil.rmtree(_HOME.pop("path"), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def quiet_machine():  # noqa: ANN201
    """The load signal of calibration reads quiet (`calibration.CpuShare`: the timing thread's CPU
    time counts as its wall time): the suite's machine is shared, and a tuning timed busy is timed
    again at the next start that finds the machine quiet, so a restart's cache hit would depend on
    other processes' load. Tests of that signal hand in their own CPU clock."""
    from rewardstack._memory import calibration

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "cpu_clock", calibration.wall_clock)
        yield


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
    from rewardstack._standins import make_standins

    root = tmp_path_factory.mktemp("standins")
    make_standins(root)
    return root


@pytest.fixture(scope="session")
def tiny_standins(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The tiny stand-in stack (`tests/soak/tiny.py`), built once per test session; returns its folder."""
    from tests.soak.tiny import make_tiny_standins

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
