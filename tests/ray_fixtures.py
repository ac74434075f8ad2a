"""Helpers for the Ray tests: one local 2-CPU cluster per module, small runs, the stand-in config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from rewardstack.config import StackConfig
from rewardstack.workload import heavy_tailed_steps

ray = pytest.importorskip("ray")


def local_cluster() -> Iterator[None]:
    """A local Ray with 2 CPUs for one test module; always shut down."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rewardstack-tests")
    try:
        yield
    finally:
        ray.shutdown()


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
