"""`rewardstack soak`: injected OOMs inside real passes, a kill and a restart, compared with a clean run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rewardstack.cli import main
from rewardstack.memory import FaultInjector, MemoryManager
from rewardstack.memory.guard import InjectedOOM
from rewardstack.replay.soak import LONG_CHARS, compare, memory_slope, soak_steps

from test_replay_run import _oa_config


def test_injected_oom_strikes_inside_the_pass_and_its_tensors_are_freed() -> None:
    mm = MemoryManager(None, device="cpu")
    mm.injector = FaultInjector(1.0, seed=1, models=["m"])
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
    mm.injector = FaultInjector(0.0, seed=1)
    out = mm.run("m", [4], lambda idx: [float(torch.ones(3).sum())])
    assert out[0].value == 3.0 and not mm.oom_log and mm.injector.calls == 1


def test_workload_lengths() -> None:
    steps = soak_steps(60, 20, seed=0)
    chars = sorted(len(c or "") for s in steps for c in s.completions)
    assert chars[len(chars) // 2] >= 200
    long_steps = [i for i, s in enumerate(steps) if any(len(c or "") >= LONG_CHARS for c in s.completions)]
    assert long_steps == [10] or long_steps == [10, 60][: len(long_steps)]


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


def test_short_soak_with_a_kill(standins: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    rd = tmp_path / "soak"
    # Pathological inputs have their own test; here they would only make every input hit the bound.
    rc = main(["soak", "--config", str(_oa_config(standins, tmp_path)), "--steps", "16", "--completions", "4",
               "--faults", "0.1", "--kills", "1", "--run-dir", str(rd), "--seed", "3"])
    out = capsys.readouterr().out
    v = json.loads((rd / "summary.json").read_text())["soak"]
    assert rc == 0, out
    assert v["passed"] and v["kills"] == 1 and v["restarts"] == 1 and v["crashes"] == 0
    assert v["comparison"]["events"] == 16 and v["comparison"]["duplicates"] == 0 and v["comparison"]["missing"] == 0
    assert v["comparison"]["normalizers_equal"] and v["comparison"]["mismatched_values"] == 0
    o = v["ooms"]
    # Each injected OOM was split around or given up on (a single input: reported 'oom', out of the statistics).
    assert o["injected"] > 0 and o["injected"] + o["real"] == o["recovered"] + o["gave_up"]
    assert o["reported"] >= min(1, o["gave_up"])
    assert v["input_errors"] == 0 and v["memory"]["slope_bytes_per_step"] <= 1024
    assert "soak verdict: PASS" in out


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
