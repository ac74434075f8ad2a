"""`rewardstack replay`: the input behind the OpenAssistant peak, the reference's need, fit, agreement, warm start."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from rewardstack.cli import main
from rewardstack._replay.readers import read_run
from rewardstack._replay.replay import parse_steps, replay
from rewardstack.stack import RewardStack
from rewardstack._state import RunningNormalizer, StateStore
from tests.soak.synthetic import text

from conftest import use_builder
from replay_fixtures import PASSES, event, loguru_line, write_rotated_log


def _oa_config(root: Path, tmp_path: Path) -> Path:
    """The OpenAssistant stand-in alone (weight 1) with the rule masks."""
    cfg = tmp_path / "oa.toml"
    off = "\n".join(f"[models.{m}]\nweight = 0.0\n" for m in
                    ("dpo_reward_model", "reciprocate_reward_model", "dahoas_reward_model", "prompt_reward_model"))
    masks = "\n".join(f"[models.{m}]\nenabled = false\n" for m in ("relevance_filter", "diversity_reward_model", "nsfw_filter"))
    cfg.write_text(f'device = "cpu"\nstate_dir = "state"\n[models.rlhf_reward_model]\npath = "{root / "rlhf_reward_model"}"\n'
                   f'weight = 1.0\ndtype = "float32"\n{off}\n{masks}\n')
    return cfg


def _run_with_one_long_completion(path: Path, long_at: tuple[int, int], logged: dict | None = None) -> Path:
    rng = random.Random(5)
    names = ["augment", "followup0", "answer0", "followup1"]
    lines = []
    for s, name in enumerate(names):
        comps = [text(rng, rng.randint(150, 400)) for _ in range(5)]
        if s == long_at[0]:
            comps[long_at[1]] = text(rng, 36_000)
        ev = {"name": name, "prompt": text(rng, 120), "completions": comps, "best": comps[0]}
        if logged is not None:
            ev["rlhf_reward_model"] = logged[s]
        lines.append(loguru_line(ev, 1689847200.0 + s))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_names_the_long_input_behind_the_openassistant_peak(standins: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    log = _run_with_one_long_completion(tmp_path / "completions.log", (2, 3))
    rc = main(["replay", str(log), "--config", str(_oa_config(standins, tmp_path)), "--run-dir", str(tmp_path / "rd"),
               "--budget", "64MiB", "--top", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads((tmp_path / "rd" / "summary.json").read_text())["replay"]
    top = summary["top_inputs"]["rlhf_reward_model"]
    assert (top[0]["step"], top[0]["index"]) == (2, 3)
    assert top[0]["chars"] > 30_000 and top[0]["tokens"] > 5_000
    # The reference (DeBERTa-v3-large, float32, untruncated) needs gigabytes for it; rewardstack far less.
    assert top[0]["reference_bytes"] > 1024**3 and top[0]["reference_largest_bytes"] > 256 * 1024**2
    assert top[0]["used_bytes"] < 64 * 1024**2
    assert "step 2, completion 3" in out and "the unbounded reference would have needed" in out
    assert "would have run out of memory at step 2, completion 3" in out
    assert summary["fits"] is True and summary["steps"] == 4
    assert (tmp_path / "rd" / "events.jsonl").exists()
    assert not (tmp_path / "state").exists()  # replay never touches the config's state


def test_agreement_with_logged_values(standins: Path, tmp_path: Path) -> None:
    from rewardstack.config import load_config

    cfg = load_config(_oa_config(standins, tmp_path))
    cfg.state_dir = str(tmp_path / "s1")
    first = _run_with_one_long_completion(tmp_path / "a.log", (-1, 0))
    stack = RewardStack(cfg, load_state=False)
    events: list[dict] = []
    replay(stack, read_run([first]).steps, reference=False, on_event=events.append)
    logged = [list(e["rlhf_reward_model"]) for e in events]
    logged[3][4] += 0.01  # the validator disagreed on one input
    second = _run_with_one_long_completion(tmp_path / "b.log", (-1, 0), logged)
    cfg.state_dir = str(tmp_path / "s2")
    report = replay(RewardStack(cfg, load_state=False), read_run([second]).steps, reference=False)
    a = report.agreement["rlhf_reward_model"]
    assert (a.compared, a.within) == (20, 19)
    assert a.max_diff == pytest.approx(0.01, rel=1e-3)
    assert (a.worst[0]["step"], a.worst[0]["index"]) == (3, 4)


def test_steps_selection() -> None:
    assert list(parse_steps("2:4", 10)) == [2, 3]
    assert list(parse_steps("8:", 10)) == [8, 9] and list(parse_steps(":2", 10)) == [0, 1]
    assert list(parse_steps("5", 10)) == [5] and list(parse_steps(None, 3)) == [0, 1, 2]


def test_init_state_from_logged_values(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    folder = write_rotated_log(tmp_path / "run")
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cpu"\nstate_dir = "state"\n')
    assert main(["replay", str(folder), "--config", str(cfg), "--init-state"]) == 0
    sections = StateStore(tmp_path / "state").load()
    # OpenAssistant: the logged raw values (NaN = failed, never counted), folded step by step.
    want = RunningNormalizer()
    for p in PASSES:
        want.update([x for x in p["rlhf"] if math.isfinite(x)])
    got = sections["normalizers"]["rlhf_reward_model"]
    assert got["count"] == want.count == 22
    assert got["mean"] == pytest.approx(want.mean, abs=1e-12) and got["var"] == pytest.approx(want.var, abs=1e-12)
    # DPO was not logged: scored (the fake scores every live completion).
    assert sections["normalizers"]["dpo_reward_model"]["count"] == sum(
        sum(c is not None for c in rs.step.completions) for rs in read_run([folder]).steps)
    # The blacklist holds the last forward pass (the second augment: nothing recorded yet).
    assert sections["stack"]["steps_scored"] == len(PASSES)
    capsys.readouterr()
    assert main(["replay", str(folder), "--config", str(cfg), "--init-state"]) == 1
    assert "never overwrites" in capsys.readouterr().err


def test_init_state_folds_a_stateful_masks_forward_pass_into_the_state(tmp_path: Path, fake_registry,  # noqa: ANN001
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Diversity's history is built by running its stateless part (`Scorer.stateless_part`) on each
    logged step and folding the vectors into the state, as a scored step does."""
    use_builder(monkeypatch, "diversity_reward_model", "fakes:build_embeddings")
    folder = write_rotated_log(tmp_path / "run")
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cpu"\nstate_dir = "state"\n')
    assert main(["replay", str(folder), "--config", str(cfg), "--init-state"]) == 0
    history = StateStore(tmp_path / "state").load()["diversity_reward_model"]["history"]
    live = [[c for c in rs.step.completions if c is not None] for rs in read_run([folder]).steps]
    # A step's row equal to the one before it is not stored again (`DiversityHistory`).
    assert len(history) == sum(sum(j == 0 or t[j] != t[j - 1] for j in range(len(t))) for t in live) > 0


def test_init_state_blacklist_mid_pass(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    path = tmp_path / "completions.log"
    path.write_text("\n".join(loguru_line(event(p, i), 1.0 + i) for i, p in enumerate(PASSES[:4])) + "\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cpu"\nstate_dir = "state"\n')
    assert main(["replay", str(path), "--config", str(cfg), "--init-state"]) == 0
    bl = StateStore(tmp_path / "state").load()["blacklist_filter"]
    assert bl["question_blacklist"] == ["How fast do rivers erode rock?", "Which rivers are oldest?"]
    assert bl["answer_blacklist"] == ["It depends on the rock."]
