"""OOM incident records: an injected OOM and a simulated-device OOM each name the input behind them."""

from __future__ import annotations

import hashlib
import json

from fault_fixtures import CountingInjector
from rewardstack.stack import RewardStack
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir, read_incidents, read_timeline
from telemetry_fixtures import BYTES_PER_TOKEN, HOG, HogScorer, hog_config, step  # noqa: F401 - fixture


def test_injected_oom_writes_an_incident_naming_the_input(hog_config, tmp_path) -> None:  # noqa: ANN001
    HogScorer.max_batch = 1
    stack = RewardStack(hog_config(), load_state=False)
    # Every device pass of the hog runs out of memory: each input falls back to the CPU.
    stack.memory.injector = CountingInjector(rate=1.0, seed=0, models=[HOG])
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    s = step(0, n=3)
    s["completions"][0] = None  # a failed response: the hog's input 0 is completion 1
    result = stack.score_step(s, save=False)
    mon.close()
    incidents = read_incidents(tmp_path / "run")
    assert len(incidents) == 2
    # The manager's policy decides what follows a single input's OOM: the CPU, or the `oom` status.
    action = incidents[0]["action"]
    assert result.model_statuses[HOG] == ["failed"] + (["ok", "ok"] if action == "cpu_fallback" else ["oom", "oom"])
    for inc, completion in zip(incidents, (1, 2)):
        assert inc["step"] == 1 and inc["model"] == HOG and inc["action"] == action and inc["injected"]
        (inp,) = inc["inputs"]
        text = s["completions"][completion]
        assert inp["completion"] == completion and inp["head"] == text[:200] and inp["length"] == inc["lengths"][0]
        assert inp["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert inc["budget_bytes"] is None and inc["memory"]["source"] == "tracker"
        assert "largest_tensors" in inc and inc["cost_model"]["a"] is not None
    calls = [r for r in read_timeline(tmp_path / "run") if r["type"] == "call"]
    if action == "cpu_fallback":  # the failed device pass, then the pass on the CPU
        assert [c["outcome"] for c in calls] == ["cpu_fallback", "ok", "cpu_fallback", "ok"]
        assert [c["fallback"] for c in calls] == [False, True, False, True]
        assert [c["completions"] for c in calls] == [[1], [1], [2], [2]]
    else:
        assert [c["outcome"] for c in calls] == ["oom", "oom"] and [c["completions"] for c in calls] == [[1], [2]]
    ooms = [r for r in read_timeline(tmp_path / "run") if r["type"] == "oom"]
    assert [o["inputs"] for o in ooms] == [[1], [2]] and ooms[0]["file"] == incidents[0]["file"]


def test_simulated_device_oom_lists_the_largest_live_tensors_and_their_ops(hog_config, tmp_path) -> None:  # noqa: ANN001
    # Room for inputs of up to ~60 tokens: the long completion cannot fit even alone.
    budget = 80 * BYTES_PER_TOKEN * 2
    stack = RewardStack(hog_config(memory_budget=budget), load_state=False)
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    s = step(0, n=3, chars=40)
    s["completions"][2] = "a very long completion " * 40  # ~230 tokens
    stack.memory.cost_models[HOG].a = 0.0
    stack.memory.cost_models[HOG].b = 0.0  # a cost model that believes anything fits
    stack.memory.cost_models[HOG].c = 0.0
    stack.score_step(s, save=False)
    mon.close()
    incidents = read_incidents(tmp_path / "run")
    assert incidents, "the oversized batch should have run out of memory"
    last = incidents[-1]
    names = {i["completion"] for inc in incidents for i in inc["inputs"]}
    assert 2 in names  # the long completion is named
    assert not last["injected"] and last["budget_bytes"] == budget
    assert last["tracker"]["requested_bytes"] > 0 and "aten." in last["tracker"]["requested_by"]
    assert all("aten." in t["op"] and t["bytes"] > 0 for t in last["largest_tensors"])
    assert json.loads((tmp_path / "run" / "incidents" / last["file"]).read_text())["model"] == HOG
