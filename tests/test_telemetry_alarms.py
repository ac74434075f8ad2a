"""Leak alarms: a leaking scorer trips within the window; a clean run of hundreds of steps does not."""

from __future__ import annotations

import logging
import random

from rewardstack.stack import RewardStack
from rewardstack._memory.device import MemorySnapshot
from rewardstack._telemetry.alarms import Alarms
from rewardstack._telemetry.monitor import Monitor
from telemetry_fixtures import HOG, HogScorer, hog_config, step  # noqa: F401 - fixture

MIB = 1024**2


def test_leaking_scorer_trips_the_leak_alarm_within_the_window(hog_config, caplog) -> None:  # noqa: ANN001
    HogScorer.leak_per_step = 2 * MIB  # kept on the simulated device after every step
    stack = RewardStack(hog_config(), load_state=False)
    window = 12
    mon = Monitor.attach(stack, alarms=Alarms(window=window, warmup=2, leak_bytes_per_step=MIB))
    seen: list[dict] = []
    stack.on_step.append(seen.append)
    with caplog.at_level(logging.WARNING, logger="rewardstack.telemetry"):
        for k in range(2 + window + 3):
            stack.score_step(step(k), save=False)
    mon.close()
    tripped = [r["step"] for r in seen if "device_allocated" in r["alarms"]]
    assert tripped == [2 + window], tripped  # the first step the window is full, and only once
    assert any("device_allocated grows +2.000 MiB/step" in m for m in caplog.messages)


def _rest(alloc: int, rss: int) -> MemorySnapshot:
    return MemorySnapshot(time=0.0, source="tracker", allocated=alloc, host_rss=rss)


def test_clean_run_of_hundreds_of_steps_never_trips(hog_config) -> None:  # noqa: ANN001
    stack = RewardStack(hog_config(), load_state=False)
    mon = Monitor.attach(stack, alarms=Alarms(window=50, warmup=5))
    seen: list[dict] = []
    stack.on_step.append(seen.append)
    for k in range(300):
        stack.score_step(step(k, n=3, chars=16 + (k * 37) % 200), save=False)
    mon.close()
    assert len(seen) == 300 and not any(r["alarms"] for r in seen)
    slopes = mon.alarms.verdict()["slopes"]
    # The windows filled (the alarms were judged every step), and nothing trended.
    assert slopes["device_allocated"] is not None and slopes["host_rss"] is not None
    assert mon.alarms.trends == [] and abs(slopes["device_allocated"]) < 1024


def test_declared_bounded_growth_is_subtracted() -> None:
    # The host grows 3 MiB per step, all of it declared (the diversity history filling): no alarm.
    rng = random.Random(0)
    alarms = Alarms(window=20, warmup=0, host_leak_bytes_per_step=MIB)
    for k in range(100):
        declared = min(k, 60) * 3 * MIB
        noise = rng.randint(-200_000, 200_000)
        assert alarms.observe(k, _rest(0, 500 * MIB + declared + noise), {"host": declared}) == []
    # The same growth, undeclared, trips the host alarm.
    alarms = Alarms(window=20, warmup=0, host_leak_bytes_per_step=MIB)
    tripped = [t for k in range(100) for t in alarms.observe(k, _rest(0, 500 * MIB + min(k, 60) * 3 * MIB), {})]
    assert [t.series for t in tripped] == ["host_rss"] and tripped[0].last_step == 19


def test_fragmentation_alarm_on_cuda_figures() -> None:
    alarms = Alarms(window=10, warmup=0)
    tripped = []
    for k in range(30):
        snap = MemorySnapshot(time=0.0, source="cuda", allocated=1000 * MIB, reserved=1000 * MIB + k * 8 * MIB,
                              inactive_split=k * 8 * MIB)
        tripped += alarms.observe(k, snap)
    assert {t.series for t in tripped} == {"fragmentation", "inactive_split_share"}
    assert alarms.verdict()["fragmentation"] and not alarms.verdict()["leak"]
