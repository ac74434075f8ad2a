"""Replaying rewardstack's own events agrees with itself: events carry the base prompt they were scored with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import use_builder
from rewardstack import config as config_mod
from rewardstack._replay.readers import read_run
from rewardstack._replay.replay import replay
from rewardstack._runner import score_file
from rewardstack.stack import RewardStack

# No step gives a base prompt: `score` uses each step's prompt. Each followup/answer's words
# overlap its prompt but not the previous best, so a base rebuilt from the best changes relevance.
STEPS = [
    {"name": "augment", "prompt": "Tell me about rivers and valleys.",
     "completions": ["Rivers carve valleys slowly.", "Mountains stand tall."]},
    {"name": "followup0", "prompt": "Ask a question about erosion of granite.",
     "completions": ["How does granite erosion happen?", "Rivers carve valleys slowly?"]},
    {"name": "answer0", "prompt": "Answer the question about sediment transport.",
     "completions": ["Sediment transport needs water.", "How does granite erosion happen?"]},
]


@pytest.fixture
def relevance_reads_its_base(monkeypatch: pytest.MonkeyPatch, fake_registry) -> None:  # noqa: ANN001
    use_builder(monkeypatch, "relevance_filter", "fakes:build_relevance")


def test_replaying_own_events_agrees_fully(tmp_path: Path, relevance_reads_its_base: None) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(s) + "\n" for s in STEPS))
    events = tmp_path / "events.jsonl"
    cfg = config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "state")})
    score_file(RewardStack(cfg), steps, events, progress=False)
    written = [json.loads(x) for x in events.read_text().splitlines()]
    assert [e["base_prompt"] for e in written] == [s["prompt"] for s in STEPS]

    run = read_run([events])
    assert [rs.step.base_prompt for rs in run.steps] == [s["prompt"] for s in STEPS]
    cfg2 = config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "state2")})
    report = replay(RewardStack(cfg2, load_state=False), run.steps, reference=False)
    a = report.agreement["relevance_filter"]
    assert a.compared > 0 and a.within == a.compared, a.worst


def test_replaying_own_events_keeps_a_cut_completion_cut(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    from rewardstack._replay.replay import format_report, top_inputs

    # Past the default max_chars (65,536), and the head read ends in a space: kept as read, not stripped.
    long = "w" * 65_535 + " tail" * 1_000
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"name": "augment", "prompt": "Tell me about rivers.",
                                 "completions": ["Rivers carve valleys.", long, None]}) + "\n")
    events = tmp_path / "events.jsonl"
    score_file(RewardStack(config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "s")})), steps, events,
               progress=False)
    written = json.loads(events.read_text())
    # The event says it was cut, and at which length: what was read is what it keeps.
    assert written["statuses"] == ["ok", "cut", "failed"] and len(written["completions"][1]) == 65_536

    run = read_run([events])
    got: list[dict] = []
    # Under a budget too: the comparison with the unbudgeted pass must not call `cut` a change.
    cfg = config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "s2"), "memory_budget": 1 << 30})
    report = replay(RewardStack(cfg, load_state=False), run.steps, reference=False, on_event=got.append)
    assert got[0]["statuses"] == written["statuses"]
    assert got[0]["completions"] == written["completions"] and written["completions"][1].endswith("w ")
    assert all(a.within == a.compared > 0 for a in report.agreement.values()), report.agreement
    assert got[0]["model_statuses"] == written["model_statuses"]
    assert report.completions == {"ok": 1, "cut": 1, "failed": 1}
    assert report.changed == [] and report.fits, report.verdict()
    # The fakes run no model, so nothing peaks: name the input behind a measured peak by hand.
    report.top = top_inputs(RewardStack(cfg, load_state=False), run.steps, {0: {"rlhf_reward_model": 1}}, 1, False)
    assert report.top["rlhf_reward_model"][0].recorded_cut
    text = format_report(report)
    assert "step 0, completion 1: 65536 chars" in text and "cut at 65536 characters by the recorded run" in text, text
