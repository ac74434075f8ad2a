"""The run directory's cap: timeline and incidents stay within max_bytes; events are never dropped."""

from __future__ import annotations

import json

from rewardstack._telemetry.rundir import INCIDENTS, RunDir, read_timeline, timeline_files


def _dir_bytes(root) -> int:  # noqa: ANN001
    """Bytes of everything under the cap, measured on disk (not the RunDir's own count)."""
    files = timeline_files(root) + [p for p in (root / INCIDENTS).iterdir()]
    return sum(p.stat().st_size for p in files)


def test_cap_holds_and_events_are_kept(tmp_path) -> None:  # noqa: ANN001
    cap = 64 * 1024
    rd = RunDir(tmp_path, max_bytes=cap, keep_incidents=1000)
    worst = 0
    for k in range(3000):
        rd.timeline({"type": "call", "step": k, "model": "m", "lengths": list(range(20)), "peak_bytes": k * 1000})
        if k % 100 == 0:
            rd.incident({"step": k, "model": "m", "inputs": [{"head": "x" * 200}] * 10})
            rd.event({"name": "augment", "k": k, "rewards": [float("nan"), 1.0]})
        rd.flush()
        worst = max(worst, _dir_bytes(tmp_path))
    rd.close()
    assert worst <= cap, worst
    assert len(timeline_files(tmp_path)) > 1  # it rotated
    kept = [r["step"] for r in read_timeline(tmp_path)]
    assert kept == sorted(kept) and kept[-1] == 2999 and kept[0] > 0  # the newest stay, the oldest went
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["k"] for e in events] == list(range(0, 3000, 100))  # none dropped
    assert events[0]["rewards"] == [None, 1.0]  # strict JSON
    incidents = sorted((tmp_path / INCIDENTS).glob("*.json"))
    assert incidents and "step2900" in incidents[-1].name  # the newest incident stays


def test_keep_incidents_and_reopen_appends(tmp_path) -> None:  # noqa: ANN001
    rd = RunDir(tmp_path, keep_incidents=3)
    for k in range(5):
        rd.incident({"step": k, "model": "rlhf_reward_model"})
    rd.timeline({"type": "step", "step": 1})
    rd.close()
    assert [p.name[:6] for p in sorted((tmp_path / INCIDENTS).glob("*.json"))] == ["000003", "000004", "000005"]
    rd = RunDir(tmp_path, keep_incidents=3)  # a resumed run appends
    rd.timeline({"type": "step", "step": 2})
    rd.close()
    assert [r["step"] for r in read_timeline(tmp_path)] == [1, 2]


def test_a_reopened_run_numbers_incidents_after_the_newest_kept(tmp_path) -> None:  # noqa: ANN001
    """After the cap dropped the oldest records, a resumed run's next incident is numbered after the
    newest on disk: counting the files would reuse a kept number (overwriting that record when the
    step and model match) and sort the new record among the old, where the cap drops it first."""
    rd = RunDir(tmp_path, keep_incidents=3)
    for k in range(5):
        rd.incident({"step": 7, "model": "rlhf_reward_model", "k": k})
    rd.close()
    rd = RunDir(tmp_path, keep_incidents=3)
    rd.incident({"step": 7, "model": "rlhf_reward_model", "k": 5})
    rd.close()
    files = sorted((tmp_path / INCIDENTS).glob("*.json"))
    assert [p.name[:6] for p in files] == ["000004", "000005", "000006"]
    assert [json.loads(p.read_text())["k"] for p in files] == [3, 4, 5]
