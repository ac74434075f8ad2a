"""`rewardstack replay --init-state`: warm-start a stack's state from a validator's recorded run.

    rewardstack replay LOG... --config C --init-state

Rebuilds the normalizer statistics (from the logged raw values where the log has them, else by
scoring), the blacklist (from the logged bests) and the diversity history (by embedding), and
writes them as the state in C's `state_dir`; it refuses to overwrite a state.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rewardstack.config import REWARD_MODELS, StackConfig
from rewardstack.errors import StateError
from rewardstack._replay.readers import Run, RunStep


def warm_start(stack: Any, steps: list[RunStep]) -> dict[str, int]:
    """Fold a recorded run into the stack's state: normalizers, blacklist, diversity history.

    Reward models whose raw values the log holds are not run: the logged values (failed calls
    excluded) update the normalizers. Others are scored. Diversity embeds each step's completions
    (its history needs vectors); the blacklist records the logged bests. Returns how many steps
    used logged values per model and how many were scored.
    """
    from rewardstack._scorers.base import ScoreRequest, ScoreResult, Status
    from rewardstack._state import ForwardResult

    counts: dict[str, int] = {"logged": 0, "scored": 0}
    for rs in steps:
        step = rs.step
        base = step.base_prompt if step.base_prompt is not None else step.prompt
        results: dict[str, Any] = {}
        embeddings: dict[str, Any] = {}
        for name, scorer in stack.scorers.items():
            if name in REWARD_MODELS:
                logged = rs.logged.get(name)
                if logged is not None:
                    scores = [x if c is not None else math.nan for x, c in zip(logged, step.completions)]
                    sts = [Status.FAILED if c is None else (Status.OK if math.isfinite(x) else Status.ERROR)
                           for x, c in zip(scores, step.completions)]
                    results[name] = ScoreResult(scores, sts)
                    counts["logged"] += 1
                else:
                    results[name] = stack.run_scorer(name, ScoreRequest(step.prompt, step.completions, step.name))
                    counts["scored"] += 1
            elif scorer.stateful:  # its stateless half (diversity's embeddings); the state folds it in
                part = stack.run_stateless_part(name, ScoreRequest(base, step.completions, step.name))
                if part is not None:
                    embeddings[name] = part
        stack.state.apply(ForwardResult(step, results, embeddings))
    return counts


def cmd_init_state(args: argparse.Namespace, cfg: StackConfig, run: Run, steps: list[RunStep]) -> int:
    """`replay --init-state`: write the run's state into the config's state_dir (refuses to overwrite)."""
    from rewardstack.stack import RewardStack
    from rewardstack._state import StateLock, StateStore

    with StateLock(cfg.state_dir):
        if StateStore(cfg.state_dir).path.exists():
            raise StateError(f"{cfg.state_dir} already holds a state: --init-state never overwrites one; "
                             "move it away or set another state_dir")
        stack = RewardStack(cfg, load_state=False)
        counts = warm_start(stack, steps)
        stack.save_state()
    print(f"state written to {cfg.state_dir} from {len(steps)} steps "
          f"({counts['logged']} model-steps from logged values, {counts['scored']} scored)")
    for name in REWARD_MODELS:
        if name in stack.scorers:
            n = stack.normalizers[name]
            print(f"  {name}: count {n.count}, mean {n.mean:.6g}, var {n.var:.6g}")
    return 0


__all__ = ["cmd_init_state", "warm_start"]
