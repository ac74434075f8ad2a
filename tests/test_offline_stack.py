"""End to end on the offline stand-in stack: the CLI writes complete events, edge cases included."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rewardstack.cli import main
from rewardstack.config import ALL_MODELS
from rewardstack._state import StateStore

EVENT_FIELDS = {
    "name", "prompt", "completions", "uids", "completion_times", "rewards", "best", "step_length",
    "block", "gating_loss", "set_weights",
}


def test_score_on_standins_writes_every_field_and_handles_edge_cases(standins: Path, tmp_path: Path) -> None:
    sample = (Path(__file__).resolve().parents[1] / "src/rewardstack/data/sample_steps.jsonl").read_text()
    edge = [
        {"name": "augment", "prompt": "A prompt.", "completions": []},
        {"name": "followup0", "prompt": "A prompt.", "completions": ["Only one question here?"]},
        {"name": "answer0", "prompt": "A prompt.", "completions": ["x", "y"], "failed": [True, True]},
    ]
    steps = tmp_path / "steps.jsonl"
    steps.write_text(sample + "".join(json.dumps(e) + "\n" for e in edge))
    # Beside the stand-ins, so the relative model paths resolve; state goes to this test's folder.
    config = standins / f"stack-{tmp_path.name}.toml"
    config.write_text((standins / "stack.toml").read_text().replace('state_dir = "state"', f'state_dir = "{tmp_path / "state"}"'))
    out = tmp_path / "events.jsonl"
    assert main(["score", "--config", str(config), "--input", str(steps), "--output", str(out)]) == 0
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(events) == 6
    for ev in events:
        assert EVENT_FIELDS | set(ALL_MODELS) | {n + "_normalized" for n in ALL_MODELS} <= set(ev)
        n = len(ev["completions"])
        assert len(ev["rewards"]) == n and len(ev["statuses"]) == n
        assert all(r is not None and math.isfinite(r) for r in ev["rewards"])
    first = events[0]
    assert first["statuses"][4] == "failed" and first["rlhf_reward_model"][4] is None
    assert first["blacklist_filter"][2] == 0.0 and first["task_validator_filter"][3] == 0.0
    empty, one, failed = events[3:]
    assert empty["rewards"] == [] and empty["best"] == ""
    # One completion: its variance counts as 0, so the statistics stay finite after it.
    assert all(math.isfinite(one[n + "_normalized"][0]) for n in ALL_MODELS) and one["statuses"] == ["ok"]
    assert failed["statuses"] == ["failed", "failed"] and failed["rewards"] == [0.0, 0.0]
    assert all(v is None for v in failed["dpo_reward_model"])
    # Diversity is a stateful mask: the stack ran its embeddings and the validator's state kept
    # them, one row per live completion (a row equal to the one before it in a step is not kept).
    history = StateStore(tmp_path / "state").load()["diversity_reward_model"]["history"]
    live = [[c for c, st in zip(ev["completions"], ev["statuses"]) if st != "failed"] for ev in events]
    assert len(history) == sum(sum(j == 0 or t[j] != t[j - 1] for j in range(len(t))) for t in live) > 0
