"""Prometheus metrics, scraped over real HTTP from a loopback port and parsed by prometheus_client."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fault_fixtures import CountingInjector
from rewardstack.stack import RewardStack
from rewardstack._telemetry.session import Telemetry
from rewardstack._telemetry.rundir import read_timeline
from rewardstack._telemetry.metrics import metrics_for, render, serve
from telemetry_fixtures import HOG, HogScorer, hog_config, step  # noqa: F401 - fixture


def _scrape(port: int) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fam, **labels) -> float:  # noqa: ANN001
    return sum(s.value for s in fam.samples if all(s.labels.get(k) == v for k, v in labels.items())
               and not s.name.endswith(("_created", "_bucket")))


def test_metrics_scraped_over_http(hog_config, tmp_path) -> None:  # noqa: ANN001
    HogScorer.max_batch = 2
    stack = RewardStack(hog_config(memory_budget=64 * 1024**2), load_state=False)
    stack.memory.injector = CountingInjector(rate=1.0, seed=0, models=[HOG])  # every device pass: OOM, recovered
    reg = CollectorRegistry()
    tel = Telemetry(stack, run_dir=tmp_path / "run", metrics_port=0, registry=reg)
    try:
        results = [stack.score_step(step(k, n=4), save=False) for k in range(3)]
        fams = _scrape(tel.server.server_port)
    finally:
        tel.close()
    for name, fam in fams.items():  # Prometheus naming: prefix, units, counters
        assert name.startswith("rewardstack_"), name
        if fam.type == "counter":
            assert all(s.name in (name + "_total", name + "_created") for s in fam.samples), name
        if fam.type in ("gauge", "histogram") and not name.endswith("_created"):  # a counter's creation time
            # a unit, or for a count the plural of what it counts (as vLLM's `request_prompt_tokens`)
            assert name.endswith(("_bytes", "_seconds", "_ratio", "_requests", "_inputs", "_tokens")), name
    assert _value(fams["rewardstack_steps"]) == 3
    hog_statuses = [st for r in results for st in r.model_statuses[HOG]]
    for status in set(hog_statuses):
        assert _value(fams["rewardstack_completions"], model=HOG, status=status) == hog_statuses.count(status)
    assert _value(fams["rewardstack_completions"], model="nsfw_filter", status="ok") == 12
    # 4 inputs per step, batches of 2: each batch splits (recovered); each single input then runs
    # on the CPU (recovered) or is marked `oom` (lost), as the manager's policy says.
    actions = [r.action for r in stack.memory.oom_log]
    assert actions.count("split") == 3 * 2 and len(actions) == 3 * (2 + 4)
    assert _value(fams["rewardstack_ooms_recovered"], model=HOG) == sum(a != "gave_up" for a in actions)
    assert _value(fams["rewardstack_ooms_lost"], model=HOG) == actions.count("gave_up") == hog_statuses.count("oom")
    assert _value(fams["rewardstack_memory_budget_bytes"]) == 64 * 1024**2
    assert _value(fams["rewardstack_device_memory_allocated_bytes"]) == stack.memory.tracker.live_bytes
    # One duration per call record, one peak per call record with a measured peak.
    calls = [r for r in read_timeline(tmp_path / "run") if r["type"] == "call" and r["model"] == HOG]
    assert len(calls) >= len(actions)
    secs = fams["rewardstack_model_call_duration_seconds"]
    assert [s.value for s in secs.samples if s.name.endswith("_count") and s.labels["model"] == HOG] == [len(calls)]
    peak = fams["rewardstack_model_call_peak_bytes"]
    measured = sum(c["peak_bytes"] is not None for c in calls)
    assert [s.value for s in peak.samples if s.name.endswith("_count") and s.labels["model"] == HOG] == ([measured] if measured else [])
    assert _value(fams["rewardstack_step_duration_seconds"]) > 0
    assert "rewardstack_placement_swaps" in fams and "rewardstack_model_call_duration_seconds" in fams
    # The same registry renders for the service to mount.
    body, ctype = render(reg)
    assert b"rewardstack_steps_total 3.0" in body and ctype.startswith("text/plain")


def test_metrics_are_served_on_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback"):
        serve(0, host="0.0.0.0", reg=CollectorRegistry())
    reg = CollectorRegistry()
    assert metrics_for(reg) is metrics_for(reg)  # registered once per registry


def test_a_taken_port_is_a_clear_error(hog_config) -> None:  # noqa: ANN001
    from rewardstack.errors import ConfigError

    reg = CollectorRegistry()
    first = serve(0, reg=reg)
    try:
        stack = RewardStack(hog_config(), load_state=False)
        with pytest.raises(ConfigError, match="metrics_port"):
            Telemetry(stack, run_dir=None, metrics_port=first.server_port, registry=CollectorRegistry())
        assert stack.memory.observers == [] and stack.on_step == []  # nothing left attached
        assert [type(o).__name__ for o in stack.step_observers] == ["OperatorLog"]
    finally:
        first.shutdown()
        first.server_close()
