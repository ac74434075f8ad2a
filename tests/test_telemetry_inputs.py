"""Every telemetry record that names an input names the step's completion and its opening text.

The scorers number their inputs their own way: DPO skips empty and too-short completions, the
classifiers score identical texts once and cut long ones into windows, relevance embeds the prompt
with the completions. A record naming an input by the scorer's own numbering names the wrong text
(issue 34: "input 2, 8192 tokens" was completion 4). The tiny stand-in stack scores a step with an
empty, a null, a short and a 200,000-character completion, then a step whose DPO passes all run
out of memory; the call records, the summary, the incidents, the timeline's `oom` records and the
report must all name completions by the step's index, with the text that index has.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import standin_config
from fault_fixtures import CountingInjector
from rewardstack.stack import RewardStack
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir, read_incidents, read_timeline
from rewardstack._telemetry.report import summarize, RunData

DPO = "dpo_reward_model"
LONG = ("The long completion goes on and on about rewards. " * 5000)[:200_000]
STEP1 = {"name": "augment", "prompt": "Summarize the history of the bicycle in a few sentences.",
         "completions": ["The bicycle began as the draisine in 1817 and gained pedals later.", "", None, "ok", LONG,
                         "Bicycles spread widely once the safety bicycle appeared in the 1880s."]}
STEP2 = {"name": "followup0", "prompt": "Ask a question about bicycles.",
         "completions": [None, "", "What made the safety bicycle safer than the penny-farthing?", "Why chains, not belts?"]}
# DPO scores a completion only when it is not blank and longer than 5 characters.
DPO_SCORED = {1: {0, 4, 5}, 2: {2, 3}}


def _run(tiny_standins: Path, tmp_path: Path) -> tuple[Path, list[dict]]:
    stack = RewardStack(standin_config(tiny_standins, tmp_path / "state"), load_state=False)
    run = tmp_path / "run"
    mon = Monitor.attach(stack, run_dir=RunDir(run))
    stack.score_step(STEP1, save=False)
    stack.memory.injector = CountingInjector(rate=1.0, seed=0, models=[DPO])  # every DPO pass runs out of memory
    stack.score_step(STEP2, save=False)
    mon.close()
    return run, [STEP1, STEP2]


def test_every_record_names_the_steps_completion_and_its_text(tiny_standins: Path, tmp_path: Path) -> None:
    run, steps = _run(tiny_standins, tmp_path)
    texts = {k + 1: s["completions"] for k, s in enumerate(steps)}
    records = list(read_timeline(run))
    calls = [r for r in records if r["type"] == "call"]
    assert {c["model"].split("[")[0] for c in calls} >= {DPO, "rlhf_reward_model", "relevance_filter", "nsfw_filter"}
    for c in calls:
        comps = c["completions"]
        # Every input is named: a completion of the step, or None for the prompt (relevance embeds it).
        assert comps is not None and len(comps) == len(c["inputs"]), (c["model"], c["inputs"], comps)
        for j, comp in enumerate(comps):
            if comp is None:
                assert c["model"].startswith("relevance_filter"), c["model"]
                continue
            assert texts[c["step"]][comp] is not None, (c["model"], comp)  # a failed response is never run
        lg = c["longest"]
        assert lg["completion"] == comps[c["inputs"].index(lg["input"])]
        if lg["completion"] is not None:
            assert lg["head"] == texts[c["step"]][lg["completion"]][:80]
    for k, want in DPO_SCORED.items():
        got = {x for c in calls if c["model"] == DPO and c["step"] == k for x in c["completions"]}
        assert got == want, (k, got)
    # The largest DPO input is the 200,000-character completion 4 (cut to DPO's 8,192 tokens).
    top = max((c for c in calls if c["model"] == DPO), key=lambda c: c["padded_length"])
    assert top["longest"]["completion"] == 4 and top["longest"]["head"] == LONG[:80]
    summary = json.loads((run / "summary.json").read_text())
    dpo_top = [t for t in summary["top_calls"] if t["model"] == DPO]
    assert dpo_top and dpo_top[0]["longest"]["completion"] == 4 and dpo_top[0]["longest"]["head"] == LONG[:80]
    # Step 2: every DPO pass ran out of memory; the incidents and `oom` records name completions 2 and 3.
    incidents = [i for i in read_incidents(run) if i["model"] == DPO]
    assert incidents
    for inc in incidents:
        for inp in inc["inputs"]:
            assert inp["completion"] in DPO_SCORED[2] and inp["head"] == texts[2][inp["completion"]][:200]
    ooms = [r for r in records if r["type"] == "oom" and r["model"] == DPO]
    assert ooms and {x for o in ooms for x in o["inputs"]} == DPO_SCORED[2]
    # The report's line for the highest DPO peak names completion 4 and its opening words.
    line = next(x for x in summarize(RunData(run))["Top inputs behind the peaks"] if f"{DPO}:" in x and "step 1" in x)
    assert "completion 4, 8192 tokens" in line and LONG[:40] in line, line
