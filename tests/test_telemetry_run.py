"""Telemetry end to end: a stand-in run with --run-dir, every record's fields, a known-answer peak,
the report, and the stack's `on_step` callbacks."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from rewardstack.cli import main
from rewardstack.stack import RewardStack
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir, read_timeline
from rewardstack._telemetry.report import PLOTS, write_report
from telemetry_fixtures import BYTES_PER_TOKEN, EXTRA_BYTES, HOG, HogScorer, hog_config, step, tokens  # noqa: F401 - fixture

# Every field of every record type, as docs/TELEMETRY.md lists them ("?" marks fields that may be absent).
CALL = {"type", "model", "time", "seconds", "batch", "padded_length", "padded_tokens", "lengths", "inputs", "n_inputs",
        "predicted_bytes", "peak_bytes", "start_bytes", "error_ratio", "outcome", "on_host", "fallback", "injected",
        "step", "step_name", "completions", "longest", "prefix_tokens"}
STEP = {"type", "step", "name", "time", "seconds", "completions", "statuses", "model_statuses", "models", "calls",
        "ooms", "peak_bytes", "rest", "budget_bytes", "budget_line_bytes", "declared", "alarms", "card",
        "profiling_seconds", "profiles"}
STEP_MODEL = {"calls", "seconds", "peak_bytes", "predicted_bytes", "ooms"}
START = {"type", "time", "device", "source", "budget_bytes", "budget", "budget_line_bytes", "rest", "cost_models", "models"}
END = {"type", "time", "steps"}
TRACKER_SNAPSHOT = {"time", "source", "allocated", "reserved", "active", "inactive_split", "peak", "num_alloc_retries",
                    "num_ooms", "host_rss", "host_rss_peak"}
SUMMARY = {"started", "updated", "device", "budget_bytes", "steps", "completions", "models", "top_calls", "ooms",
           "incidents", "incident_files", "swaps", "alarms", "rest", "profiling"}
OUTCOMES = {"ok", "split", "cpu_fallback", "oom", "error"}


def _steps_file(path, n: int = 3) -> None:  # noqa: ANN001
    path.write_text("".join(json.dumps({**step(k, n=5, chars=40 + 90 * k), "base_prompt": f"base {k}"}) + "\n"
                            for k in range(n)), encoding="utf-8")


def test_standin_run_writes_every_record_with_its_fields(standins, tmp_path) -> None:  # noqa: ANN001
    steps, run = tmp_path / "steps.jsonl", tmp_path / "run"
    _steps_file(steps)
    # The stand-ins under a 64 MiB simulated device: the tracker's figures fill the snapshots. (The
    # config sits beside stack.toml: model paths are relative to its folder.)
    config = standins / f"telemetry-{tmp_path.name}.toml"
    text = (standins / "stack.toml").read_text()
    assert 'state_dir = "state"' in text
    config.write_text(text.replace('state_dir = "state"', f'state_dir = "{tmp_path / "state"}"\nmemory_budget = 67108864'),
                      encoding="utf-8")
    assert main(["score", "--config", str(config), "--input", str(steps), "--output", str(tmp_path / "out.jsonl"),
                 "--run-dir", str(run)]) == 0
    records = list(read_timeline(run))
    kinds = [r["type"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("step") == 3
    calls = [r for r in records if r["type"] == "call"]
    assert sum(not c["on_host"] for c in calls) >= 6
    assert {owner.split("[")[0] for owner in (c["model"] for c in calls)} >= {"rlhf_reward_model", "dpo_reward_model", "relevance_filter"}
    for r in records:
        want = {"call": CALL, "step": STEP, "start": START, "end": END}[r["type"]]
        assert set(r) - {"longest"} == want - {"longest"}, (r["type"], set(r) ^ want)
    for c in calls:
        assert c["outcome"] in OUTCOMES and c["step"] in (1, 2, 3) and isinstance(c["step_name"], str)
        # A pass on the simulated device has a measured peak; one that placement ran in host memory has none.
        # (What each field holds is checked against a model with known passes below.)
        assert (c["peak_bytes"] is None) == c["on_host"] and (c["on_host"] or c["peak_bytes"] > 0)
        assert set(c["longest"]) == {"input", "completion", "length", "head"}
    for s in (r for r in records if r["type"] == "step"):
        assert set(s["rest"]) == TRACKER_SNAPSHOT | {"device_free", "device_total"}
        assert s["rest"]["device_total"] == s["budget_bytes"] == 64 * 1024**2
        assert sum(s["statuses"].values()) == s["completions"] == 5
        for m in s["models"].values():
            assert set(m) == STEP_MODEL
    # The events are the scores, one per step, as `score` wrote them to --output.
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    output = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(events) == len(output) == 3  # (the output adds the runner's resume fields)
    assert all(e == {k: v for k, v in o.items() if k in e} and "rewards" in e for e, o in zip(events, output))
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == SUMMARY and summary["steps"] == 3

    # The report on that directory: five PNGs and one self-contained page.
    assert main(["report", str(run)]) == 0
    out = run / "report"
    for name, _ in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(PLOTS)
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_call_records_are_the_passes_the_model_ran(hog_config, tmp_path) -> None:  # noqa: ANN001
    """Every call record against what the hog itself saw: its indices, their token lengths (from
    the texts, by the fixture's tokenizer), the padded shape, the peak its arithmetic implies
    (two float32 tensors of BYTES_PER_TOKEN per padded token live at once) and the step's count."""
    HogScorer.max_batch = 2  # several passes a step, of different shapes
    stack = RewardStack(hog_config(), load_state=False)
    hog = stack.scorers[HOG]
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    texts = [["a" * 8, "b" * 200, "c" * 40], ["d" * 120, "e" * 4, "f" * 64, "g" * 16, "h" * 100]]
    passes_per_step = []
    for k, comps in enumerate(texts):
        before = len(hog.passes)
        stack.score_step({"name": "augment", "prompt": f"prompt {k}", "completions": comps}, save=False)
        passes_per_step.append(hog.passes[before:])
    mon.close()
    records = list(read_timeline(tmp_path / "run"))
    for k, (comps, passes) in enumerate(zip(texts, passes_per_step)):
        calls = [r for r in records if r["type"] == "call" and r["model"] == HOG and r["step"] == k + 1]
        assert len(calls) == len(passes) == math.ceil(len(comps) / 2)
        for c, (idx, padded) in zip(calls, passes):
            assert c["inputs"] == idx and c["batch"] == len(idx) and c["n_inputs"] == len(comps)
            assert c["lengths"] == [tokens(comps[i]) for i in idx] and c["padded_length"] == padded
            assert c["padded_tokens"] == len(idx) * padded
            want = 2 * BYTES_PER_TOKEN * len(idx) * padded
            assert abs(c["peak_bytes"] - want) <= 0.02 * want + 4096, (c["peak_bytes"], want)
            # The cost model was fitted on this very pass: its prediction is close, and the ratio says so.
            assert abs(c["predicted_bytes"] - want) <= 0.1 * want and abs(c["error_ratio"]) <= 0.1
            assert c["outcome"] == "ok" and not c["on_host"] and 0 <= c["seconds"] < 60
        step_rec = next(r for r in records if r["type"] == "step" and r["step"] == k + 1)
        assert step_rec["calls"] >= len(passes) and step_rec["models"][HOG]["calls"] == len(passes)


def test_known_answer_extra_64_mib_in_the_second_call(hog_config, tmp_path) -> None:  # noqa: ANN001
    HogScorer.extra_on_call = 2  # the second model call only
    HogScorer.max_batch = 1  # one input per call: the second call is completion 1 of the first step
    stack = RewardStack(hog_config(), load_state=False)
    run = RunDir(tmp_path / "run")
    mon = Monitor.attach(stack, run_dir=run)
    steps = [step(k) for k in range(3)]
    for s in steps:
        stack.score_step(s, save=False)
    mon.close()
    calls = [r for r in read_timeline(tmp_path / "run") if r["type"] == "call" and r["model"] == HOG]
    assert len(calls) == 12
    baseline = statistics.median(c["peak_bytes"] for c in calls)
    extra = [(c, c["peak_bytes"] - baseline) for c in calls if c["peak_bytes"] - baseline > 0.05 * EXTRA_BYTES]
    assert len(extra) == 1, [c["peak_bytes"] for c in calls]
    c, got = extra[0]
    assert abs(got - EXTRA_BYTES) <= 0.05 * EXTRA_BYTES
    assert c is calls[1] and c["step"] == 1 and c["model"] == HOG and c["completions"] == [1]
    assert c["longest"]["completion"] == 1 and steps[0]["completions"][1].startswith(c["longest"]["head"])
    # The prediction does not know about the extra: its error shows it.
    assert c["error_ratio"] > 100
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["top_calls"][0]["step"] == 1 and summary["top_calls"][0]["longest"]["completion"] == 1


def test_on_step_callbacks_receive_the_step_memory_record(hog_config) -> None:  # noqa: ANN001
    stack = RewardStack(hog_config(), load_state=False)
    seen: list[dict] = []
    stack.on_step.append(seen.append)  # no monitor: the record comes from a snapshot
    stack.score_step(step(0), save=False)
    assert seen[0]["step"] == 1 and seen[0]["rest"]["source"] == "tracker" and seen[0]["models"] == {}
    mon = Monitor.attach(stack)  # with a monitor: per-model figures, filled in before the callbacks run
    stack.score_step(step(1), save=False)
    assert mon in stack.step_observers and mon in stack.memory.observers
    assert seen[1]["step"] == 2 and seen[1]["models"][HOG]["calls"] >= 1 and seen[1]["models"][HOG]["peak_bytes"] > 0
    mon.close()
    assert stack.on_step == [seen.append] and stack.memory.observers == [] and mon not in stack.step_observers


def test_snapshot_of_the_simulated_device() -> None:
    from rewardstack._memory import TensorBytesTracker
    from rewardstack._memory.device import take_snapshot

    import torch

    tracker = TensorBytesTracker(32 * 1024**2)
    before = take_snapshot("cpu", tracker)
    with tracker:
        kept = torch.zeros(1024**2 // 4)
    after = take_snapshot("cpu", tracker)
    assert after.source == before.source == "tracker" and after.device_total == before.device_total == 32 * 1024**2
    assert after.allocated - before.allocated == 1024**2 and after.device_free == before.device_free - 1024**2
    assert after.nvml_used is None and "nvml_used" not in after.to_dict()  # never guessed
    del kept
