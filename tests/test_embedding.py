"""Tests of the relevance and diversity masks on the MiniLM stand-ins: parity with a literal
per-completion implementation of the spec, one embedding per text per step across both masks,
history persistence, failed and empty steps, and flat peak memory for a 40,000-character input."""

from __future__ import annotations

import math
import random

import pytest
import torch

from encoder_fixtures import (
    RefDiversity, config, make_runtime, random_texts, ref_bert_embedding, ref_relevance_mask, ref_relevance_scores,
    standin_root,
)
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._scorers.embedding import build_diversity, build_relevance
from tests.soak.synthetic import text

BASE = "The validator network scores miners with reward models; über naïve café 東京 data memory."


@pytest.fixture(scope="module")
def stand(tmp_path_factory):  # noqa: ANN001, ANN201
    return standin_root(tmp_path_factory)


def build_pair(stand, rt=None, **rel_extra):  # noqa: ANN001, ANN003, ANN201
    """Relevance and diversity on one runtime (a runtime reused: models and calibration shared)."""
    root, entries = stand
    rt = rt or make_runtime()
    rel = build_relevance(config("relevance_filter", root, entries["relevance_filter"], **rel_extra), rt)
    div = build_diversity(config("diversity_reward_model", root, entries["diversity_reward_model"]), rt)
    return rt, rel, div


@pytest.fixture(scope="module")
def pair(stand):  # noqa: ANN001, ANN201
    return build_pair(stand)


@pytest.fixture()
def fresh(pair, stand):  # noqa: ANN001, ANN201
    """A new relevance/diversity pair on the shared runtime, with an empty embedding cache."""
    pair[0].options["embedding_cache"].clear()
    return lambda **kw: build_pair(stand, pair[0], **kw)


def test_shared_checkpoint(pair) -> None:  # noqa: ANN001
    rt, rel, div = pair
    assert rel.second is div.embedder and rel.second.model is div.embedder.model  # loaded once
    assert rel.kind == div.kind == "mask"
    assert rel.first.max_length == 512


def test_relevance_parity(fresh) -> None:  # noqa: ANN001
    texts = random_texts(11, 120, max_chars=1500) + [text(random.Random(1), 3500)]  # several windows
    _, rel, _ = fresh()
    m1, t1, m2, t2 = rel.first.model, rel.first.tokenizer, rel.second.model, rel.second.tokenizer
    raw = ref_relevance_scores(m1, t1, m2, t2, BASE, texts)
    # The stand-in's scores sit far from the production bounds: put the bounds inside the sample
    # so both stages pass and stop completions, half-way between two scores (a bound equal to a
    # score would compare the last bit of a batched pass against a pass of one).
    k = len(raw) // 3
    bounds = tuple((s[k - 1] + s[k]) / 2 for s in (sorted(r[0] for r in raw), sorted(r[1] for r in raw)))
    _, rel, _ = fresh(options={"bounds": list(bounds)})
    res = rel.score(ScoreRequest(BASE, list(texts)))
    want = [ref_relevance_mask(r, bounds) for r in raw]
    assert res.scores == want
    assert set(want) == {0.0, 1.0}
    assert set(res.statuses) == {Status.OK}


def test_relevance_parity_short_windows(fresh) -> None:  # noqa: ANN001
    """A 32-token bound makes many overflow windows out of short texts (cheap window coverage)."""
    texts = random_texts(12, 25, max_chars=400)
    _, rel, _ = fresh(max_length=32, options={"bounds": [-1.0, -1.0]})
    m1, t1 = rel.first.model, rel.first.tokenizer
    got = rel.first.embed([BASE] + texts)
    for t, (v, st) in zip([BASE] + texts, got):
        want = ref_bert_embedding(m1, t1, t, max_length=32)
        assert st == Status.OK and torch.allclose(v, want, rtol=1e-4, atol=1e-6)
    res = rel.score(ScoreRequest(BASE, list(texts)))
    assert res.scores == [1.0] * len(texts)


def test_diversity_parity_with_history(fresh) -> None:  # noqa: ANN001
    _, _, div = fresh()
    ref = RefDiversity(div.embedder.model, div.embedder.tokenizer)
    g = torch.Generator().manual_seed(0)
    seeded = torch.nn.functional.normalize(torch.randn(520, 384, generator=g), dim=1)
    for step in range(3):
        texts = random_texts(20 + step, 20, max_chars=1000)
        texts[3] = texts[2]  # identical neighbours: one history row is dropped
        if step == 1:  # a history past 502 rows switches the history part on
            div.load_state_dict({"history": torch.cat([seeded, div.history])})
            ref.history = torch.cat([seeded, ref.history])
        got = div.score(ScoreRequest(BASE, list(texts))).scores
        want = ref.score(texts)
        assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got, want)), step
        assert torch.allclose(div.history, ref.history, atol=1e-6)


def test_each_text_embedded_once_per_step(fresh) -> None:  # noqa: ANN001
    rt, rel, div = fresh(options={"bounds": [-1.0, 0.0]})  # every completion reaches model 2
    rows = {"bert": 0, "mpnet": 0}

    def counter(key):  # noqa: ANN001, ANN202
        def hook(_mod, _args, kwargs):  # noqa: ANN001, ANN202
            rows[key] += kwargs["input_ids"].shape[0]
        return hook

    h1 = rel.first.model.register_forward_pre_hook(counter("bert"), with_kwargs=True)
    h2 = rel.second.model.register_forward_pre_hook(counter("mpnet"), with_kwargs=True)
    try:
        texts = random_texts(30, 15, max_chars=600)
        texts = list(dict.fromkeys(texts))
        rel.score(ScoreRequest(BASE, texts))
        div.score(ScoreRequest(BASE, texts))
    finally:
        h1.remove()
        h2.remove()
    assert rows == {"bert": len(texts) + 1, "mpnet": len(texts) + 1}  # base prompt once, each text once


def test_history_persists_through_state_dict(fresh, tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    _, _, first = fresh()
    assert first.state_dict() == {}
    first.score(ScoreRequest(BASE, random_texts(40, 12)))
    state = first.state_dict()
    assert state["history"].shape == (12, 384)
    save_file(state, str(tmp_path / "div.safetensors"))  # how the stack stores it
    _, _, second = fresh()
    second.load_state_dict(load_file(str(tmp_path / "div.safetensors")))
    step2 = random_texts(41, 12)
    a = first.score(ScoreRequest(BASE, list(step2)))
    b = second.score(ScoreRequest(BASE, list(step2)))
    assert a.scores == b.scores and torch.equal(first.history, second.history)
    second.load_state_dict({"history": first.history.tolist()})  # JSON-able form accepted too
    assert torch.equal(first.history, second.history)


def test_failed_and_empty(pair) -> None:  # noqa: ANN001
    _, rel, div = pair
    for scorer in (rel, div):
        assert scorer.score(ScoreRequest(BASE, [])).scores == []
        res = scorer.score(ScoreRequest(BASE, [None, "a fine answer", "", None]))
        assert res.statuses[0] == res.statuses[3] == Status.FAILED
        assert math.isnan(res.scores[0]) and math.isnan(res.scores[3])
        assert not math.isnan(res.scores[1]) and not math.isnan(res.scores[2])
        assert scorer.score(ScoreRequest(BASE, [None])).statuses == [Status.FAILED]
    assert div.score(ScoreRequest(BASE, ["alone"])).scores == [1.0]  # no other completion to be near


@pytest.mark.parametrize("which", ["relevance", "diversity"])
def test_long_completion_peak_memory_is_flat(fresh, which) -> None:  # noqa: ANN001
    rt, rel, div = fresh(options={"bounds": [-1.0, 0.0]})
    scorer, embedder = (rel, rel.first) if which == "relevance" else (div, div.embedder)
    rng = random.Random(9)
    peak = {}
    for n in (500, 24_000, 40_000):  # 24,000 characters (~4,800 tokens) fill a pass of the plan's size
        rt.options["embedding_cache"].clear()
        peak[n] = rt.memory.measure(lambda n=n: scorer.score(ScoreRequest(BASE, [text(rng, n)])))
    assert peak[40_000] <= 1.1 * peak[24_000], peak
    windows = max(1, embedder.max_tokens // embedder.max_length)  # windows one pass may hold
    assert peak[40_000] <= 8 * windows * peak[500], peak
