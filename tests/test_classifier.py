"""Tests of the OpenAssistant reward model and the NSFW mask on their tiny stand-ins: parity with a
literal per-completion implementation of the spec, the truncation side, failed and empty steps, and
flat peak memory for a 40,000-character completion."""

from __future__ import annotations

import math
import random

import pytest

from encoder_fixtures import close, config, make_runtime, random_texts, ref_nsfw, ref_openassistant, standin_root
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._scorers.classifier import build_nsfw, build_openassistant
from tests.soak.synthetic import text

PROMPT = "Summarize the text about the validator network and its reward models, über naïve 東京."


@pytest.fixture(scope="module")
def stand(tmp_path_factory):  # noqa: ANN001, ANN201
    return standin_root(tmp_path_factory)


@pytest.fixture(scope="module")
def oa(stand):  # noqa: ANN001, ANN201
    root, entries = stand
    return build_openassistant(config("rlhf_reward_model", root, entries["rlhf_reward_model"]), make_runtime())


@pytest.fixture(scope="module")
def nsfw(stand):  # noqa: ANN001, ANN201
    root, entries = stand
    return build_nsfw(config("nsfw_filter", root, entries["nsfw_filter"]), make_runtime())


def test_openassistant_bound_ignores_absurd_tokenizer_length(oa) -> None:  # noqa: ANN001
    assert oa.tokenizer.model_max_length > 1e6  # the stand-in mirrors DeBERTa-v3's ~1e30
    assert oa.max_length == 512
    assert oa.kind == "reward" and oa.name == "rlhf_reward_model"


def test_openassistant_parity(oa) -> None:  # noqa: ANN001
    texts = random_texts(1, 200, max_chars=1200)
    res = oa.score(ScoreRequest(PROMPT, list(texts)))
    for t, s, st in zip(texts, res.scores, res.statuses):
        assert len(oa.tokenizer(PROMPT, t)["input_ids"]) <= 512  # within the model's length
        assert st == Status.OK
        assert close(s, ref_openassistant(oa.model, oa.tokenizer, PROMPT, t)), (t[:40], s)


def test_openassistant_cuts_the_completion_side(oa) -> None:  # noqa: ANN001
    long = text(random.Random(3), 6000)
    ids, _, cut = oa.encode(PROMPT, [long, "short"], 512)
    prompt_ids = oa.tokenizer(PROMPT)["input_ids"][:-1]  # [CLS] prompt (its [SEP] follows)
    assert cut == [True, False] and len(ids[0]) == 512
    assert ids[0][: len(prompt_ids)] == prompt_ids  # the prompt is kept whole
    comp_ids = oa.tokenizer(long, add_special_tokens=False)["input_ids"]
    kept = ids[0][len(prompt_ids) + 1 : -1]
    assert kept == comp_ids[: len(kept)]  # the start of the completion is kept, its end cut
    res = oa.score(ScoreRequest(PROMPT, [long, "short"]))
    assert res.statuses == [Status.TRUNCATED, Status.OK]
    want = ref_openassistant(oa.model, oa.tokenizer, PROMPT, long, truncation="only_second", max_length=512)
    assert close(res.scores[0], want)


def test_openassistant_long_prompt_falls_back_to_longest_first(oa) -> None:  # noqa: ANN001
    prompt = text(random.Random(4), 5000)
    comp = text(random.Random(5), 300)
    res = oa.score(ScoreRequest(prompt, [comp]))
    assert res.statuses == [Status.TRUNCATED]
    want = ref_openassistant(oa.model, oa.tokenizer, prompt, comp, truncation="longest_first", max_length=512)
    assert close(res.scores[0], want)


def test_nsfw_parity_with_windows(nsfw) -> None:  # noqa: ANN001
    texts = random_texts(2, 150, max_chars=1500) + [text(random.Random(k), 2500 + 1500 * k) for k in range(4)]
    res = nsfw.score(ScoreRequest("base", list(texts)))
    assert any(len(nsfw.tokenizer(t)["input_ids"]) > 1024 for t in texts)  # several windows
    want = [ref_nsfw(nsfw.model, nsfw.tokenizer, t) for t in texts]
    assert res.scores == want
    assert set(want) == {0.0, 1.0}  # both outcomes occur on the stand-in
    assert set(res.statuses) == {Status.OK}


@pytest.mark.parametrize("which", ["oa", "nsfw"])
def test_failed_and_empty(which, request) -> None:  # noqa: ANN001
    scorer = request.getfixturevalue(which)
    assert scorer.score(ScoreRequest("p", [])).scores == []
    res = scorer.score(ScoreRequest("p", [None, "fine text", None, ""]))
    assert res.statuses[0] == res.statuses[2] == Status.FAILED
    assert math.isnan(res.scores[0]) and math.isnan(res.scores[2])
    assert all(not math.isnan(s) for s in (res.scores[1], res.scores[3]))
    all_failed = scorer.score(ScoreRequest("p", [None, None]))
    assert all_failed.statuses == [Status.FAILED] * 2


@pytest.mark.parametrize("which", ["oa", "nsfw"])
def test_long_completion_peak_memory_is_flat(which, request) -> None:  # noqa: ANN001
    scorer = request.getfixturevalue(which)
    rng = random.Random(7)
    mem = scorer.runtime.memory
    lengths = (500, 24_000, 40_000)
    peak = {n: mem.measure(lambda n=n: scorer.score(ScoreRequest(PROMPT, [text(rng, n)]))) for n in lengths}
    # Flat past the pass cap: 40,000 characters cost what 24,000 do (~4,800 tokens, a pass of the
    # plan's 4,096 tokens filled) ...
    assert peak[40_000] <= 1.1 * peak[24_000], peak
    # ... and a bounded constant times a 500-character input (512 vs ~150 tokens; attention is
    # quadratic in the window, so up to (512/150)^2 on these tiny models), per window that one
    # pass may hold (the pass cap: 8 windows in the plan, halved at load where that is faster).
    windows = max(1, scorer.max_tokens // scorer.max_length)
    assert peak[40_000] <= 16 * windows * peak[500], (peak, windows)


def test_budget_cap_truncates_instead_of_failing(stand) -> None:  # noqa: ANN001
    root, entries = stand
    rt = make_runtime(budget=6 * 1024**2)
    scorer = build_openassistant(config("rlhf_reward_model", root, entries["rlhf_reward_model"]), rt)
    cap = rt.memory.length_cap(scorer.name, 512)
    assert cap < 512
    long = text(random.Random(8), 6000)
    res = scorer.score(ScoreRequest(PROMPT, [long, "ok"]))
    assert res.statuses == [Status.TRUNCATED, Status.OK]
    assert not math.isnan(res.scores[0])
