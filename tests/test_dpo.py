"""DPO scorer: parity with a literal per-position implementation of the spec, -11 cases, memory."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import cached_runtime, close, make_runtime, model_config, reference_dpo
from rewardstack._scorers import dpo, dpo_numerics
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_dpo_standin
from tests.soak.synthetic import text


@pytest.fixture(scope="session")
def dpo_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("standins") / "dpo"
    return folder, make_dpo_standin(folder)


@pytest.fixture(scope="session")
def scorer(dpo_folder: tuple[Path, dict]) -> dpo.DpoScorer:
    folder, entry = dpo_folder
    # A small chunk so that long completions span several chunks (carried penalty counts).
    cfg = model_config("dpo_reward_model", folder, entry, options={"logits_chunk": 256})
    return dpo.build(cfg, cached_runtime(cfg))  # its fit is reused by the peak test's build


def _completions(rng: random.Random) -> list[str | None]:
    words = "alpha beta gamma delta".split()
    return [
        "", "   ", "abcde", "abcdef", None, "ü 🙂 ✓ naïve",
        text(rng, 40), text(rng, 300), text(rng, 1200),
        " ".join(rng.choice(words) for _ in range(900)),  # heavy repetition, ~1,800 tokens
        "the " * 1000,  # one token repeated ~1,000 times
        text(rng, 10_000),  # about 2,000 tokens of varied text
    ]


def test_parity_with_literal_reference(scorer: dpo.DpoScorer) -> None:
    rng = random.Random(3)
    prompt = text(rng, 400)
    comps = _completions(rng)
    res = scorer.score(ScoreRequest(prompt, comps, "augment"))
    lengths = [len(scorer.tokenizer(c).input_ids) for c in comps if c]
    assert max(lengths) >= 1900  # completions span 0 .. ~2,000 tokens
    for c, s, st in zip(comps, res.scores, res.statuses):
        if c is None:
            assert math.isnan(s) and st == Status.FAILED
            continue
        ref = reference_dpo(scorer.model, scorer.tokenizer, prompt, c)
        assert close(s, ref, 1e-4), (c[:30], s, ref)
        assert st == Status.OK


def test_penalty_is_applied(scorer: dpo.DpoScorer) -> None:
    prompt = "Repeat after me:"
    comp = "the " * 200
    got = scorer.score(ScoreRequest(prompt, [comp])).scores[0]
    unpenalized = reference_dpo(scorer.model, scorer.tokenizer, prompt, comp, penalty=1.0)
    assert close(got, reference_dpo(scorer.model, scorer.tokenizer, prompt, comp))
    assert abs(got - unpenalized) > 1e-2  # the test above would notice a missing penalty


def test_low_score_cases(scorer: dpo.DpoScorer) -> None:
    res = scorer.score(ScoreRequest("p", ["", "12345", "     x", None]))
    assert res.scores[:2] == [-11.0, -11.0]
    assert res.scores[2] == pytest.approx(reference_dpo(scorer.model, scorer.tokenizer, "p", "     x"))
    long_prompt = "word " * 9000  # over 8,192 tokens: P >= max_len
    res = scorer.score(ScoreRequest(long_prompt, ["a fine completion"]))
    assert res.scores == [-11.0]
    assert scorer.score(ScoreRequest("p", [None, None])).statuses == [Status.FAILED] * 2


def test_max_length_cut(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("standins") / "dpo_short"
    entry = make_dpo_standin(folder, max_length=300)
    sc = dpo.build(model_config("dpo_reward_model", folder, entry, options={"logits_chunk": 64}), make_runtime())
    rng = random.Random(5)
    prompt = text(rng, 600)
    comps = [text(rng, 200), text(rng, 3000), "go " * 400, text(rng, 20)]
    res = sc.score(ScoreRequest(prompt, comps))
    assert Status.TRUNCATED in res.statuses
    for c, s in zip(comps, res.scores):
        assert close(s, reference_dpo(sc.model, sc.tokenizer, prompt, c), 1e-4)
    # A prompt at or over the cut scores -11.
    assert sc.score(ScoreRequest(text(rng, 3000), ["a fine completion"])).scores == [-11.0]


def test_batched_equals_alone_and_prefix_off(dpo_folder: tuple[Path, dict], scorer: dpo.DpoScorer) -> None:
    rng = random.Random(9)
    prompt = text(rng, 300)
    comps = [text(rng, rng.randint(6, 800)) for _ in range(12)]
    batched = scorer.score(ScoreRequest(prompt, comps)).scores
    alone = [scorer.score(ScoreRequest(prompt, [c])).scores[0] for c in comps[:4]]
    folder, entry = dpo_folder
    # Profiled to 2,048 tokens (every input here is under 1,200): the fit only shapes batches here.
    plain = dpo.build(model_config("dpo_reward_model", folder, entry,
                                   options={"shared_prefix": False, "calibration_length": 2048}), make_runtime())
    no_prefix = plain.score(ScoreRequest(prompt, comps)).scores
    for a, b in zip(batched, alone):
        assert close(a, b)
    for a, b in zip(batched, no_prefix):
        assert close(a, b)


def test_peak_memory_bounded_by_chunk(dpo_folder: tuple[Path, dict]) -> None:
    folder, entry = dpo_folder
    chunk = 256
    cfg = model_config("dpo_reward_model", folder, entry, options={"logits_chunk": chunk})
    rt = cached_runtime(cfg)  # the `scorer` fixture's settings: its fit, not profiled again (a fresh tracker)
    sc = dpo.build(cfg, rt)
    rng = random.Random(11)
    comp = text(rng, 40_000)
    n = len(sc.tokenizer("Q: " + comp).input_ids)
    assert n >= 8000
    tracker = rt.memory.tracker
    assert tracker is not None
    with tracker.watch("score") as w:  # the peak above what was live before the call
        res = sc.score(ScoreRequest("Q: ", [comp]))
    peak = w.peak_increase
    vocab = sc.lm_head.weight.shape[0]
    full = 8000 * vocab * 4
    assert res.statuses == [Status.TRUNCATED] or res.statuses == [Status.OK]
    assert math.isfinite(res.scores[0])
    assert peak < full / 8, (peak, full)
    assert peak < 6 * chunk * vocab * 4 + 64 * 2**20  # a few chunk-sized buffers plus the body


def test_budget_length_cap_and_oom_statuses(dpo_folder: tuple[Path, dict]) -> None:
    folder, entry = dpo_folder
    rt = make_runtime(budget=40 * 2**20)
    # A 4,096-token bound keeps the profile short; the 40,000-character input is past it.
    sc = dpo.build(model_config("dpo_reward_model", folder, entry, max_length=4096, options={"logits_chunk": 128}), rt)
    rng = random.Random(2)
    res = sc.score(ScoreRequest("Q: ", [text(rng, 40_000), text(rng, 100)]))
    assert res.statuses == [Status.TRUNCATED, Status.OK]
    assert all(math.isfinite(s) for s in res.scores)
    assert [(r.batch, r.length) for r in rt.memory.oom_log] == []  # planned passes held


def test_budget_below_the_prompt_is_oom_not_minus_eleven(dpo_folder: tuple[Path, dict]) -> None:
    folder, entry = dpo_folder
    rt = make_runtime(budget=4 * 2**20)
    sc = dpo.build(model_config("dpo_reward_model", folder, entry, max_length=4096,
                                options={"logits_chunk": 16, "tune_logits_chunk": False}), rt)
    cap = rt.memory.length_cap("dpo_reward_model", sc.max_len)
    assert cap < sc.max_len // 4  # the budget, not the spec's max length, is what binds
    prompt = text(random.Random(8), 8 * cap)  # more prompt tokens than the budget holds, < max_len
    assert cap < len(sc.tokenizer(prompt).input_ids) < sc.max_len
    res = sc.score(ScoreRequest(prompt, ["a completion long enough"]))
    assert res.statuses == [Status.OOM] and math.isnan(res.scores[0])


def test_tight_budget_shrinks_the_chunk_before_cutting(dpo_folder: tuple[Path, dict]) -> None:
    """Under budgets the tuned 512-row chunk cannot hold, DPO shrinks the chunk and plans from a fit
    measured at the chunk it uses: no planned pass runs out of memory.

    At 40% of what a 2,400-token input needs with 512 rows, a smaller chunk scores it whole. At 15%
    of what a 3,900-token input needs, no chunk holds it: it is cut (`truncated`), never run out of
    memory. Planned from the 512-row fit extrapolated to the smaller chunk (the old way), the 15%
    budget's long input ran out of memory (seen 2026-11-30). A 4,096-token bound keeps the
    profiles short.
    """
    folder, entry = dpo_folder
    rng = random.Random(5)
    opts = {"logits_chunk": 512, "tune_logits_chunk": False}
    cfg = model_config("dpo_reward_model", folder, entry, max_length=4096, options=opts)
    # One load-time profile for the three builds (the calibration cache, as a restart reads it);
    # the smaller chunks' fits are profiled at each budgeted build's load, never inside the step.
    free = dpo.build(cfg, cached_runtime(cfg))
    cost = free.runtime.memory.cost_model("dpo_reward_model")
    for chars, share, whole in ((12_000, 0.4, True), (19_500, 0.15, False)):
        prompt, comp = "Q: ", text(rng, chars)
        n = len(free.tokenizer(prompt + comp).input_ids)
        assert n < free.max_len == 4096
        rt = cached_runtime(cfg, budget=int(cost.predict(1, n) * share))
        sc = dpo.build(cfg, rt)
        res = sc.score(ScoreRequest(prompt, [comp, comp[: len(comp) // 2]]))
        assert [(r.batch, r.length) for r in rt.memory.oom_log] == [], (n, share)  # the plan held
        assert sc.chunks.chunk < 512 and sc.chunks.tuned_chunk == 512
        rows = sc.attention.rows  # the cost models measured at the current attention block
        used = sc.chunks.costs[(sc.chunks.chunk, rows)]
        assert used.chunk == sc.chunks.chunk and used is not sc.chunks.costs[(512, rows)]  # measured at that chunk
        if whole:
            want = free.score(ScoreRequest(prompt, [comp])).scores[0]
            assert res.statuses[0] == Status.OK and close(res.scores[0], want, 1e-5)
        else:
            assert res.statuses[0] == Status.TRUNCATED and math.isfinite(res.scores[0])


def test_chunk_sizes_and_lse_paths_agree(scorer: dpo.DpoScorer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk tuned at load changes speed only; the shift-free log-sum-exp equals the shifted one."""
    assert 1 <= scorer.chunks.chunk <= scorer.chunks.max_chunk and scorer.chunks.chunk in scorer.chunks.timings
    rng = random.Random(4)
    prompt = text(rng, 200)
    comps = [text(rng, 600), "the " * 300, text(rng, 50)]
    base = scorer.score(ScoreRequest(prompt, comps)).scores
    tuned = scorer.chunks.tuned_chunk
    try:
        for c in (16, 512):
            scorer.chunks.tuned_chunk = c
            for a, b in zip(scorer.score(ScoreRequest(prompt, comps)).scores, base):
                assert close(a, b, 1e-5), (c, a, b)
    finally:
        scorer.chunks.tuned_chunk = tuned
    h = torch.randn(8, scorer.lm_head.weight.shape[1])
    assert scorer.logit_head.bound(h) >= float((scorer.lm_head(h) * scorer.scale).abs().max())  # the bound holds
    monkeypatch.setattr(dpo_numerics, "SAFE_EXP", -1.0)  # never provably bounded: the max-shift path
    shifted = scorer.score(ScoreRequest(prompt, comps)).scores
    for c, s, b in zip(comps, shifted, base):
        assert close(s, b, 1e-5)
        assert close(s, reference_dpo(scorer.model, scorer.tokenizer, prompt, c), 1e-4)
