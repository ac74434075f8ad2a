"""`replay --budget`: `fits` only when the budget cut no input and changed no status; else it names them."""

from __future__ import annotations

import random
from pathlib import Path

from rewardstack.config import load_config
from rewardstack._replay.readers import read_run
from rewardstack._replay.replay import replay
from rewardstack.stack import RewardStack
from tests.soak.synthetic import text

from replay_fixtures import loguru_line
from test_replay_run import _oa_config


def _log(path: Path) -> Path:
    rng = random.Random(7)
    # completion 1 of step 0: about 400 tokens, inside OpenAssistant's 512 (ok without a budget)
    first = [text(rng, 100), text(rng, 2000), text(rng, 80)]
    steps = [{"name": "augment", "prompt": text(rng, 200), "completions": first, "best": first[0]},
             {"name": "followup0", "prompt": text(rng, 200), "completions": [text(rng, 100), text(rng, 120)],
              "best": "x"}]
    path.write_text("\n".join(loguru_line(ev, 1689847200.0 + s) for s, ev in enumerate(steps)) + "\n")
    return path


def test_budget_verdict_names_the_cut_input(standins: Path, tmp_path: Path) -> None:
    cfg = load_config(_oa_config(standins, tmp_path))
    cfg.state_dir = str(tmp_path / "state")
    steps = read_run([_log(tmp_path / "run.log")]).steps
    free = replay(RewardStack(cfg, load_state=False), steps, reference=False)
    assert free.completions == {"ok": 5} and free.fits

    cfg.memory_budget = 9 * 2**20  # holds the 7.9 MiB of weights and a call of ~330 tokens, not of 400
    report = replay(RewardStack(cfg, load_state=False), steps, reference=False)
    assert not report.ooms  # nothing ran out of memory: the budget cut the input instead
    verdict = report.verdict()
    assert not report.fits and verdict.startswith("does not fit"), verdict
    assert "step 0, completion 1" in verdict and "rlhf_reward_model: ok without the budget -> truncated" in verdict
    assert "step 1" not in verdict and "completion 0" not in verdict
