"""Helpers for the Ray tests: one local 2-CPU Ray shared by the Ray test files, small runs, the stand-in config.

Starting a local Ray costs about 14 s of CPU on the 2-core CI machine (GCS, raylet, its agents and
monitors, the first idle workers: half a minute of wall time when the machine is busy), and
stopping it more. The two Ray files run in one process, one after the other (`-n 0`, or one xdist
worker: conftest's scheduler hands them out as one unit), so the second file uses the cluster the
first one started (`shared_cluster`): it starts Ray when none runs and, at the end of a module,
stops it unless a test of another Ray file is still to run in this session, so no cluster outlives
the Ray files; one still up at the end of the session (an interrupted run) is stopped then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from rewardstack.config import StackConfig
from tests.soak.synthetic import heavy_tailed_steps

ray = pytest.importorskip("ray")


def _shutdown() -> None:
    if ray.is_initialized():
        ray.shutdown()


def _another_ray_file_follows(module: pytest.Module) -> bool:
    """Whether a test of another `test_ray_*` file comes after this module's tests in this session."""
    items = module.session.items
    last = max((k for k, item in enumerate(items) if item.path == module.path), default=len(items))
    return any(item.path.name.startswith("test_ray_") and item.path != module.path for item in items[last + 1:])


def shared_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """The body of a module fixture: a local Ray with 2 CPUs, shared with the next Ray file."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rewardstack-tests")
        request.config.add_cleanup(_shutdown)
    try:
        yield
    finally:
        if cluster_stops_after(request):
            _shutdown()


def cluster_stops_after(request: pytest.FixtureRequest) -> bool:
    """Whether `shared_cluster` stops Ray at the end of this module (no other Ray file follows):
    then every actor, Serve's included, ends with it."""
    return not _another_ray_file_follows(request.node)


def standins_config(standins: Path, state_dir: Path) -> StackConfig:
    """A light stand-in stack: the OpenAssistant reward model alone, and the masks with state.

    The blacklist and the diversity history are what a run carries from step to step (with the
    normalizer), so they are what fresh state per run must reset; the other models only cost the
    2-core CI time to load in every worker.
    """
    import tomllib

    from rewardstack.config import from_dict

    data = tomllib.loads((standins / "stack.toml").read_text())
    for name, entry in data["models"].items():
        if name == "rlhf_reward_model":
            entry["weight"] = 1.0
        elif "weight" in entry:
            entry["weight"] = 0.0
        elif name not in ("blacklist_filter", "task_validator_filter", "diversity_reward_model"):
            entry["enabled"] = False
    data["state_dir"] = str(state_dir)
    # Sourced from the stand-ins' stack.toml: every stack of this config (the test's references,
    # each Ray worker and replica, a worker Ray restarts) shares the home's calibration cache, so
    # the fits and the encoders' pass width timed at load are measured once and read by the rest,
    # as a restarted operator's process reads them.
    return from_dict(data, base=standins, source=standins / "stack.toml")


def write_runs(folder: Path, n_runs: int, n_steps: int = 5, n_completions: int = 4) -> list[Path]:
    """Step JSONL runs of short completions; run 1 has a bad line and a failed completion."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(n_runs):
        steps = heavy_tailed_steps(n_steps, n_completions, seed=r, long_chars=0, prompt_chars=120)
        lines = []
        for s in steps:
            d = s.to_dict()
            d["completions"] = [c[:160] for c in d["completions"]]
            lines.append(json.dumps(d))
        if r == 1:
            d = json.loads(lines[2])
            d["completions"][1] = None
            lines[2] = json.dumps(d)
            lines.insert(3, "{not json")
        path = folder / f"run{r}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths
