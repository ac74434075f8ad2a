"""The soak (`python -m tests.soak`): injected OOMs inside real passes, kills and restarts, compared with a clean run;
the comparison's and the memory fit's judgement; the service soak."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from rewardstack._memory import MemoryManager
from rewardstack._memory.guard import InjectedOOM
from tests.soak.comparison import compare, memory_slope
from tests.soak.soak import main
from tests.soak.workload import LONG_CHARS, soak_steps
from tests.soak.verdict import judge
from rewardstack._runner import step_hash
from rewardstack.stack import Step
from rewardstack._state import StateStore

from fault_fixtures import CountingInjector


def test_injected_oom_strikes_inside_the_pass_and_its_tensors_are_freed() -> None:
    mm = MemoryManager(None, device="cpu")
    mm.injector = CountingInjector(1.0, seed=1, models=["m"])
    progress: list[int] = []
    live_at_failure: list[int] = []

    def forward(idx: list[int]) -> list[float]:
        keep = []
        for k in range(20):  # a pass that allocates as it goes
            keep.append(torch.ones(1024, 256))
            progress.append(k)
            live_at_failure.append(mm.tracker.live_bytes)
        return [float(sum(t.sum() for t in keep)) + i for i in idx]

    before = mm.tracker.live_bytes
    out = mm.run("m", [8, 8], forward)
    # Every pass failed (rate 1): split, then each single input reported 'oom' (no fallback for it).
    assert [o.status for o in out] == ["oom", "oom"]
    assert [r.action for r in mm.oom_log] == ["split", "gave_up", "gave_up"] and all(r.injected for r in mm.oom_log)
    # The first device pass had allocated (at least one tensor live) when the OOM struck inside it.
    assert progress[0] == 0 and max(live_at_failure[:1]) >= 1024 * 256 * 4
    assert mm.tracker.live_bytes == before  # the failed passes' tensors were freed
    assert issubclass(InjectedOOM, torch.OutOfMemoryError)


def test_injector_stays_out_of_passes_it_does_not_pick() -> None:
    mm = MemoryManager(None, device="cpu")
    mm.injector = CountingInjector(0.0, seed=1)
    out = mm.run("m", [4], lambda idx: [float(torch.ones(3).sum())])
    assert out[0].value == 3.0 and not mm.oom_log and mm.injector.calls == 1


def test_workload_lengths() -> None:
    steps = soak_steps(120, 20, seed=0)
    chars = sorted(len(c or "") for s in steps for c in s.completions)
    assert chars[len(chars) // 2] >= 200
    long_steps = [i for i, s in enumerate(steps) if any(len(c or "") >= LONG_CHARS - 10 for c in s.completions)]
    assert long_steps == [10, 60, 110]  # one every 50 steps, from step 10
    assert [i for i, s in enumerate(soak_steps(8, 4, seed=0)) if any(len(c or "") >= LONG_CHARS - 10 for c in s.completions)] == [4]


def test_long_completion_is_at_least_8000_tokens(standins: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(standins / "rlhf_reward_model")
    longest = max((c or "" for s in soak_steps(30, 4, seed=0) for c in s.completions), key=len)
    assert len(tok(longest)["input_ids"]) >= 8000


def test_compare_catches_a_duplicate_and_a_lost_value() -> None:
    def ev(h: str, x: float | None, status: str = "ok") -> dict:
        e = {m: [0.0] for m in ("dpo_reward_model", "reciprocate_reward_model", "dahoas_reward_model", "prompt_reward_model",
                                  "blacklist_filter", "task_validator_filter", "relevance_filter", "diversity_reward_model",
                                  "nsfw_filter")}
        e.update({"step_hash": h, "rlhf_reward_model": [x], "statuses": [status], "model_statuses": {"rlhf_reward_model": [status]}})
        return e

    clean = [ev("a", 1.0), ev("b", 2.0)]
    state = {"normalizers": {"rlhf_reward_model": {"count": 2, "mean": 1.5, "var": 0.25}}, "stack": {"steps_scored": 2}}
    ok = compare(["a", "b"], clean, clean, state, ["rlhf_reward_model"])
    assert ok["duplicates"] == 0 and ok["mismatched_values"] == 0 and ok["normalizers_equal"]
    dup = compare(["a", "b"], [clean[0], clean[0], clean[1]], clean, state, ["rlhf_reward_model"])
    assert dup["duplicates"] == 1 and not dup["in_order"]
    lost = compare(["a", "b"], [clean[0], ev("b", None)], clean, state, ["rlhf_reward_model"])
    assert lost["unexplained_exclusions"] == 1 and not lost["normalizers_equal"]
    reported = compare(["a", "b"], [clean[0], ev("b", None, "oom")], clean,
                       {"normalizers": {"rlhf_reward_model": {"count": 1, "mean": 1.0, "var": 0.0}}, "stack": {"steps_scored": 2}},
                       ["rlhf_reward_model"])
    assert reported["unexplained_exclusions"] == 0 and reported["normalizers_equal"]
    # A pass split after an OOM may move a value by float32 batching noise, counted apart; more fails.
    split = dict(ev("b", 2.000005), soak_ooms=[{"model": "rlhf_reward_model", "action": "split", "injected": True}])
    noisy = compare(["a", "b"], [clean[0], split], clean, state, ["rlhf_reward_model"])
    assert noisy["mismatched_values"] == 0 and noisy["rebatched_values"] == 1
    far = compare(["a", "b"], [clean[0], dict(split, rlhf_reward_model=[2.01])], clean, state, ["rlhf_reward_model"])
    assert far["mismatched_values"] == 1
    unsplit = compare(["a", "b"], [clean[0], ev("b", 2.000005)], clean, state, ["rlhf_reward_model"])
    assert unsplit["mismatched_values"] == 1
    # Diversity reads relevance's MPNet embeddings: a split of that pass forgives diversity's noise
    # (the 120-step soak failed on 83 such values, off by <= 2.1e-6); relevance's first model does not.
    for model, forgiven in (("relevance_filter[1]", True), ("relevance_filter[0]", False)):
        shared = dict(ev("b", 2.0), diversity_reward_model=[0.000002],
                      soak_ooms=[{"model": model, "action": "split", "injected": True}])
        got = compare(["a", "b"], [clean[0], shared], clean, state, ["rlhf_reward_model"])
        assert (got["mismatched_values"], got["rebatched_values"]) == ((0, 1) if forgiven else (1, 0)), model
    # ... and in every later step: the noisy embeddings stay in diversity's history.
    later = [ev("a", 1.0), ev("b", 2.0), ev("c", 3.0)]
    first = dict(later[0], soak_ooms=[{"model": "relevance_filter[1]", "action": "split", "injected": True}])
    state3 = {"normalizers": {"rlhf_reward_model": {"count": 3, "mean": 2.0, "var": 2 / 3}}, "stack": {"steps_scored": 3}}
    got = compare(["a", "b", "c"], [first, later[1], dict(later[2], diversity_reward_model=[0.000002])], later, state3,
                  ["rlhf_reward_model"])
    assert (got["mismatched_values"], got["rebatched_values"]) == (0, 1)
    # Diversity's own bound: its sigmoids (slope up to 250) magnify a cosine's float32 noise, so
    # 5e-5 after a split is noise there (the standard stand-ins' soak moved one by 1.0e-5) and a
    # failure anywhere else; 2e-4 fails diversity too.
    for model, moved, noise in (("diversity_reward_model", 0.00005, True), ("rlhf_reward_model", 2.00005, False),
                                ("diversity_reward_model", 0.0002, False)):
        base = {"diversity_reward_model": [0.0], "rlhf_reward_model": [2.0]}
        got = compare(["a", "b"], [clean[0], dict(ev("b", 2.0), **{**base, model: [moved]},
                                                  soak_ooms=[{"model": "relevance_filter[1]", "action": "split", "injected": True},
                                                             {"model": "rlhf_reward_model", "action": "split", "injected": True}])],
                      clean, state, ["rlhf_reward_model"])
        assert (got["mismatched_values"], got["rebatched_values"]) == ((0, 1) if noise else (1, 0)), (model, moved)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()]


TINY_SOAK_STEPS = 40  # the mechanism at CI size; the 10,000-step soak is a command (docs/REPLAY.md)


@pytest.mark.slow
def test_tiny_soak_200_steps_3_kills(tiny_standins: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """40 steps of 5 on the tiny stack (200 of 10 until 2026-12-03), 10% injected OOMs, 3 SIGKILLs:
    the verdict passes, and what it claims is recounted here from the files (events once and in
    order, OOM records, the state). Seen red at this size with a resume that lost its last
    committed event (`reconcile_output` returning one hash short: the step scored twice)."""
    rd = tmp_path / "soak"
    n = TINY_SOAK_STEPS
    rc = main(["--config", str(tiny_standins / "stack.toml"), "--steps", str(n), "--completions", "5",
               "--budget", "64MiB", "--faults", "0.1", "--kills", "3", "--run-dir", str(rd), "--seed", "3"])
    out = capsys.readouterr().out
    v = json.loads((rd / "summary.json").read_text())["soak"]
    assert rc == 0 and v["passed"], out
    expected = [step_hash(Step.from_dict(json.loads(x))) for x in (rd / "steps.jsonl").read_text().splitlines()]
    faulted, clean = _events(rd / "faulted" / "events.jsonl"), _events(rd / "clean" / "events.jsonl")
    assert [e["step_hash"] for e in faulted] == expected == [e["step_hash"] for e in clean]
    assert v["kills"] == 3 and v["restarts"] == 3 and v["crashes"] == 0 and len(v["kill_points"]) == 3
    # Three processes were killed and a fourth finished: four worker logs, three without an end line.
    logs = sorted((rd / "faulted").glob("worker-*.log"))
    assert len(logs) == 4 and sum(bool(re.search(r"^worker \d+: scored", p.read_text(), re.M)) for p in logs) == 1
    recs = [r for e in faulted for r in e["soak_ooms"]]
    assert v["ooms"]["injected"] == sum(r["injected"] for r in recs) > 0
    assert sum(r["action"] == "split" for r in recs) > 0  # recovered by splitting the pass
    # Each OOM the guard gave up on is one completion a model reported 'oom' (never silently dropped).
    gave_up = sum(r["action"] == "gave_up" for r in recs)
    assert gave_up == sum(s == "oom" for e in faulted for sts in e["model_statuses"].values() for s in sts)
    state = StateStore(rd / "faulted" / "state").load()
    assert state["stack"]["steps_scored"] == n
    assert v["memory"]["points"] >= 10 and v["memory"]["rss_slope_bytes_per_step"] is not None
    # No tensor made on the simulated device outlives its step (a kept activation would show here).
    assert v["memory"]["rest_bytes_max"] == 0
    assert "soak verdict: PASS" in out
    # The clean run's one process is fitted over (nearly) the whole run and printed.
    assert v["clean_memory"]["processes"] == 1 and v["clean_memory"]["span_steps"] >= 3 * n // 4
    assert "clean run's memory at rest" in out
    # --rejudge compares the same files again (nothing scored): the same verdict, the first kept;
    # with one committed value moved by 1e-3 it fails.
    args = ["--config", str(tiny_standins / "stack.toml"), "--steps", str(n), "--completions", "5",
            "--budget", "64MiB", "--faults", "0.1", "--kills", "3", "--rejudge", str(rd)]
    assert main(args) == 0
    again = json.loads((rd / "summary.json").read_text())
    assert again["soak_before"] == v and again["soak"]["comparison"] == v["comparison"]
    lines = (rd / "faulted" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    e = json.loads(lines[n // 2])
    # A value the comparison checks: finite, of a completion not reported lost ('oom' is skipped).
    k = next(i for i, x in enumerate(e["rlhf_reward_model"])
             if isinstance(x, float) and math.isfinite(x) and e["statuses"][i] != "oom")
    e["rlhf_reward_model"][k] += 1e-3
    lines[n // 2] = json.dumps(e)
    (rd / "faulted" / "events.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(args) == 1
    assert "values differ" in capsys.readouterr().out
    assert json.loads((rd / "summary.json").read_text())["soak_before"] == v  # the run's own verdict, kept


def test_verdict_fails_on_each_defect() -> None:
    """Each check of `judge` turns the verdict red on its own."""
    cmp = {"events": 3, "expected": 3, "missing": 0, "duplicates": 0, "in_order": True, "mismatched_values": 0,
           "unexplained_exclusions": 0, "oom_in_statistics": 0, "oom_gave_up": 1, "oom_statuses": 1,
           "normalizers_equal": True, "max_normalizer_diff": 0.0, "steps_in_state": 3}
    sup = {"kills": 1, "restarts": 1, "crashes": 0, "kill_points": []}
    memory = {"slope_bytes_per_step": 0.0, "rss_slope_bytes_per_step": 0.0, "points": 30, "span_steps": 500}
    base = dict(cmp=cmp, sup=sup, clean_sup={**sup, "kills": 0}, clean_events=3, memory=memory,
                ooms={"injected": 2}, statuses={}, kills_wanted=1, faults=0.1, max_slope=1024, max_rss_slope=16384)
    assert judge(**base)["passed"]
    bad = {
        "duplicate": {"cmp": {**cmp, "duplicates": 1}}, "order": {"cmp": {**cmp, "in_order": False}},
        "value": {"cmp": {**cmp, "mismatched_values": 1}}, "oom lost": {"cmp": {**cmp, "oom_statuses": 0}},
        "normalizers": {"cmp": {**cmp, "normalizers_equal": False}}, "state": {"cmp": {**cmp, "steps_in_state": 4}},
        "crash": {"sup": {**sup, "crashes": 1}}, "kill missed": {"kills_wanted": 2},
        "tracked leak": {"memory": {**memory, "slope_bytes_per_step": 2048.0}},
        "rss leak": {"memory": {**memory, "rss_slope_bytes_per_step": 65536.0}},
        "rss leak over the clean run": {"memory": {**memory, "rss_excess_slope_bytes_per_step": 65536.0}},
        "clean short": {"clean_events": 2}, "no faults": {"ooms": {"injected": 0}},
        # The clean run's one process is judged too: with many kills it is the only long segment.
        "clean rss leak": {"clean_memory": {**memory, "rss_slope_bytes_per_step": 65536.0, "span_steps": 1500}},
        "clean tracked leak": {"clean_memory": {**memory, "slope_bytes_per_step": 2048.0}},
    }
    assert judge(**{**base, "clean_memory": memory})["passed"]
    # A short clean run's RSS (its arenas still warming up) is reported, not judged.
    assert judge(**{**base, "clean_memory": {**memory, "rss_slope_bytes_per_step": 65536.0, "span_steps": 180}})["passed"]
    for name, change in bad.items():
        assert not judge(**{**base, **change})["passed"], name
    # Measured over the clean run's curve, young processes' arena warm-up is not a leak.
    assert judge(**{**base, "memory": {**memory, "rss_slope_bytes_per_step": 65536.0,
                                       "rss_excess_slope_bytes_per_step": 0.0}})["passed"]
    # Over short segments the RSS slope is reported, not judged (a process's arena warm-up).
    assert judge(**{**base, "memory": {**memory, "rss_slope_bytes_per_step": 65536.0, "span_steps": 40}})["passed"]


@pytest.mark.slow
def test_service_soak_with_a_kill(tiny_standins: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Two clients against `serve` on loopback, the server SIGKILLed once and restarted on its
    state: every step answered once, resends answered from the store, states equal the library's."""
    pytest.importorskip("uvicorn")
    rd = tmp_path / "svc"
    rc = main(["--service", "--config", str(tiny_standins / "stack.toml"), "--steps", "6", "--completions", "4",
               "--clients", "2", "--kills", "1", "--run-dir", str(rd), "--seed", "5"])
    out = capsys.readouterr().out
    v = json.loads((rd / "summary.json").read_text())["service_soak"]
    assert rc == 0 and v["passed"], out
    assert v["kills"] == 1 and v["server_starts"] == 2 and v["lost"] == 0 and v["applied_twice"] == 0
    assert v["requests"]["resent"] == v["requests"]["resend_from_store"] == 2  # sequences 5 of each client
    for ns in ("soak-0", "soak-1"):
        d = v["namespaces"][ns]
        assert d["sequence"] == 6 and d["answered"] == 6 and d["differing"] == 0 and d["normalizers_equal"]
        state = StateStore(rd / "service" / "state" / "namespaces" / ns).load()
        assert state["stack"]["steps_scored"] == 6


def test_memory_slope_sees_a_leak_within_each_process(tmp_path: Path) -> None:
    """Tensor bytes at rest growing 2 KiB a step in each of two processes (a restart resets the
    level) is a 2 KiB/step slope; a flat run is 0; RSS is pooled the same way."""
    def write(leak: int) -> Path:
        path = tmp_path / f"rest-{leak}.jsonl"
        rows = [{"pid": 1 if s <= 50 else 2, "steps": s, "rest_bytes": 4096 + leak * (s if s <= 50 else s - 50),
                 "rss_bytes": 2**30 + 3 * leak * s, "history_rows": 0} for s in range(1, 101)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    leaking, flat = memory_slope(write(2048), 100), memory_slope(write(0), 100)
    assert abs(leaking["slope_bytes_per_step"] - 2048) < 1 and flat["slope_bytes_per_step"] == 0
    assert abs(leaking["rss_slope_bytes_per_step"] - 3 * 2048) < 1 and flat["rss_slope_bytes_per_step"] == 0


def test_rss_is_judged_over_the_clean_runs_curve(tmp_path: Path) -> None:
    """Killed processes are young, and a young process's resident set rises steeply and then flattens
    (arenas warming up): pooled raw, five such processes read as a leak with nothing kept. Over the
    clean process's curve at the same age they are flat, and 20 KiB kept per step shows as 20 KiB."""
    from rewardstack._scorers.embedding import HISTORY_MAX

    def curve(age: int) -> int:  # the shape the 10,000-step clean run measured: 420 -> ~490 MiB
        return int(420 * 2**20 + 70 * 2**20 * (1 - math.exp(-age / 800)))

    def write(name: str, lengths: list[int], offset: int, leak: int) -> Path:
        path, rows, step = tmp_path / f"{name}.jsonl", [], 0
        for pid, n in enumerate(lengths, start=1):
            for age in range(n):
                step += 1
                rows.append({"pid": pid, "steps": step, "rest_bytes": 0, "rss_bytes": curve(age) + offset + leak * age,
                             "history_rows": HISTORY_MAX})
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    clean = write("clean", [2000], 0, 0)
    lengths = [150, 250, 400, 500, 700]  # 2,000 steps, four kills
    base = dict(cmp={"events": 1, "expected": 1, "missing": 0, "duplicates": 0, "in_order": True,
                     "mismatched_values": 0, "unexplained_exclusions": 0, "oom_in_statistics": 0, "oom_gave_up": 0,
                     "oom_statuses": 0, "normalizers_equal": True, "max_normalizer_diff": 0.0, "steps_in_state": 1},
                sup={"kills": 4, "restarts": 4, "crashes": 0, "kill_points": []},
                clean_sup={"kills": 0, "restarts": 0, "crashes": 0, "kill_points": []}, clean_events=1,
                ooms={"injected": 1}, statuses={}, kills_wanted=4, faults=0.1, max_slope=1024, max_rss_slope=16384)
    healthy = memory_slope(write("healthy", lengths, 6 * 2**20, 0), 2000, reference=clean)
    assert healthy["rss_slope_bytes_per_step"] > 16384  # raw and pooled, warm-up reads as a leak
    assert abs(healthy["rss_excess_slope_bytes_per_step"]) < 64
    assert judge(**base, memory=healthy)["passed"]
    leaking = memory_slope(write("leaking", lengths, 6 * 2**20, 20 * 1024), 2000, reference=clean)
    assert abs(leaking["rss_excess_slope_bytes_per_step"] - 20 * 1024) < 64
    v = judge(**base, memory=leaking)
    assert not v["passed"] and any("resident set grows" in f for f in v["failures"])


def test_the_faulted_run_starts_once_the_clean_run_has_calibrated(tiny_standins: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs must read one calibration: two processes calibrating at once may tune different
    logits chunks, so different budget caps, and a long completion cut at a different token (a
    soak under load failed on one DPO value, -3.1e23 against -1.1e25). So the faulted run starts
    only after the clean run's process says its stack is built. Red with the wait removed."""
    from tests.soak import soak, supervisor

    seen: dict[str, object] = {}

    class Proc:  # the clean run's process: "built" after a few polls
        polls = 0

        def poll(self) -> int | None:
            self.polls += 1
            if self.polls == 5:
                Path(seen["ready"]).touch()  # type: ignore[arg-type]
            return None

        def wait(self) -> int:
            return 0

    def spawn(cfg, steps, folder, *, ready=None, **kw):  # noqa: ANN001, ANN003, ANN202
        folder.mkdir(parents=True, exist_ok=True)
        seen["ready"] = ready
        return Proc()

    def supervise(args, steps_path, folder, n):  # noqa: ANN001, ANN202
        seen["ready_at_faulted_start"] = Path(seen["ready"]).exists()  # type: ignore[arg-type]
        return {"kills": 0, "restarts": 0, "crashes": 0, "kill_points": []}

    monkeypatch.setattr(supervisor, "spawn", spawn)
    monkeypatch.setattr(supervisor, "supervise", supervise)
    monkeypatch.setattr(soak, "judge_run", lambda *a, **k: {"passed": True})
    rc = main(["--config", str(tiny_standins / "stack.toml"), "--steps", "2", "--completions", "2",
               "--run-dir", str(tmp_path / "soak")])
    assert rc == 0 and seen["ready"] is not None and seen["ready_at_faulted_start"] is True
