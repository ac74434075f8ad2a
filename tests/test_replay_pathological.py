"""Pathological inputs: each one scored or given an explicit status, none stops a run (real stand-in models)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from rewardstack.cli import main
from rewardstack.config import load_config
from tests.soak import pathological as path
from rewardstack.stack import RewardStack, Step

SCORED = {"ok", "truncated", "cut"}  # cut: scored on the first [input] max_chars characters


def _config(root: Path, tmp_path: Path) -> Path:
    """OpenAssistant, DPO (weights 0.5 each) and the NSFW mask of the stand-ins, with the rule masks."""
    cfg = tmp_path / "p.toml"
    off = "\n".join(f"[models.{m}]\nweight = 0.0\n" for m in ("reciprocate_reward_model", "dahoas_reward_model", "prompt_reward_model"))
    cfg.write_text(
        f'device = "cpu"\nstate_dir = "state"\n'
        f'[models.rlhf_reward_model]\npath = "{root / "rlhf_reward_model"}"\nweight = 0.5\ndtype = "float32"\n'
        f'[models.dpo_reward_model]\npath = "{root / "dpo_reward_model"}"\nweight = 0.5\ndtype = "float32"\n'
        f'[models.nsfw_filter]\npath = "{root / "nsfw_filter"}"\nenabled = true\n'
        f'{off}\n[models.relevance_filter]\nenabled = false\n[models.diversity_reward_model]\nenabled = false\n'
    )
    return cfg


def test_every_pathological_kind_is_scored_or_has_an_explicit_status(standins: Path, tmp_path: Path) -> None:
    cfg = load_config(_config(standins, tmp_path))
    cfg.state_dir = str(tmp_path / "state")
    stack = RewardStack(cfg, load_state=False)
    rng = random.Random(0)
    prompt = "Explain how a compiler turns source code into machine code."
    kinds = list(path.KINDS)
    steps = [
        Step("augment", prompt, [path.completion(k, rng, prompt) for k in kinds], base_prompt=prompt),
        Step("followup0", "Ask a question about it.", ["What is a lexer?", "What is a parser?"], base_prompt=prompt),
        Step("answer0", "Answer it.", ["A lexer splits text into tokens.", "It reads characters."], base_prompt="What is a lexer?"),
    ]
    path.grow_prompts(steps)
    assert len(steps[2].prompt) > len(steps[1].prompt) > len(steps[0].prompt)
    results = []
    for step in steps:
        result = stack.score_step(step, save=False)
        results.append(result)
        for i, (st, reward) in enumerate(zip(result.statuses, result.rewards)):
            kind = kinds[i] if step is steps[0] else step.name
            assert st in SCORED or st in ("failed", "oom"), (kind, st)  # never 'error'
            assert math.isfinite(reward), kind
            for m in ("rlhf_reward_model", "dpo_reward_model"):
                x = result.raw[m][i]
                assert math.isfinite(x) or result.model_statuses[m][i] not in SCORED, (kind, m)
    first = results[0]
    by_kind = dict(zip(kinds, first.statuses))
    assert by_kind["huge"] == "cut"  # 100,000 characters: past [input] max_chars (65,536), said so
    assert first.raw["blacklist_filter"][kinds.index("prompt_itself")] == 0.0
    assert first.raw["dpo_reward_model"][kinds.index("empty")] == -11.0  # the spec's value for an empty answer
    assert first.raw["dpo_reward_model"][kinds.index("whitespace")] == -11.0


def test_unpaired_surrogate_line_is_an_input_error_and_the_rest_is_scored(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    good = Step("augment", "p", ["fine", "also fine"])
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps(good.to_dict()) + "\n" + path.surrogate_line(good) + "\n"
                     + json.dumps({**good.to_dict(), "name": "followup0"}) + "\n")
    (tmp_path / "c.toml").write_text('device = "cpu"\nstate_dir = "state"\n')
    rc = main(["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps), "--output", str(tmp_path / "ev")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 2" in err and "surrogate" in err
    assert [json.loads(x)["name"] for x in (tmp_path / "ev").read_text().splitlines()] == ["augment", "followup0"]


def test_control_characters_survive_the_event_file(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    rng = random.Random(1)
    comps = [path.completion(k, rng, "p") for k in ("control_chars", "rtl", "astral")]
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps(Step("augment", "p", comps).to_dict(), ensure_ascii=False) + "\n")
    (tmp_path / "c.toml").write_text('device = "cpu"\nstate_dir = "state"\n')
    assert main(["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps), "--output", str(tmp_path / "ev")]) == 0
    lines = (tmp_path / "ev").read_text(encoding="utf-8").rstrip("\n").split("\n")
    assert len(lines) == 1  # a NUL or a line separator inside a completion never splits the record
    assert json.loads(lines[0])["completions"] == [c.strip() for c in comps]
    # And a rerun reads the record back as one committed step (resumes, scores nothing again).
    capsys.readouterr()
    assert main(["score", "--config", str(tmp_path / "c.toml"), "--input", str(steps), "--output", str(tmp_path / "ev")]) == 0
    assert "scored 0 steps" in capsys.readouterr().err
