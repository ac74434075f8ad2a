"""Every model-backed scorer on adversarial input: heavy repetition and lengths past every bound.

One step of the stand-in stack (every model on, float32 as its config says) whose completions
repeat one token hundreds of times, repeat a multi-byte word, run past every model's maximum, or
are tiny. Each scorer's raw value with status `ok` must equal a literal, one-completion-at-a-time
transcription of the reference in the same dtype (or the reference's fallback value, which the
transcription returns itself: DPO's -11); a `truncated` value must equal the reference on the
input cut as docs/SEMANTICS.md says. DPO's float16 extremes and the judge's literal parity run on
small-vocabulary models in tests/test_dpo_extremes.py and tests/test_judge_reference.py.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import close, reference_dahoas, reference_dpo
from conftest import standin_config
from encoder_fixtures import RefDiversity, ref_nsfw, ref_openassistant, ref_relevance_mask, ref_relevance_scores
from rewardstack._scorers.base import Status
from rewardstack.stack import RewardStack
from tests.soak.synthetic import text

PROMPT = "Write about the model and its reward."
BASE = "The model and its reward."
DPO_REFERENCE_TOKENS = 2_000  # past this the literal reference's [L, 30522] logits cost gigabytes


def adversarial() -> dict[str, str]:
    rng = random.Random(23)
    return {
        "one_token_1500": " the" * 1500,
        "one_word_700": " reward" * 700,
        "multibyte_800": " 東京" * 800,
        "varied_past_every_bound": text(rng, 30_000),
        "alternating_900": " yes no" * 450,
        "six_chars": "abcdef",
        "tiny": "ok",
        # Blacklisted: the stock phrase and the base prompt itself (the mask must give them 0).
        "stock_phrase": "That is an excellent question.",
        "base_prompt": BASE,
    }


@pytest.fixture(scope="module")
def scored(standins: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    stack = RewardStack(standin_config(standins, tmp_path_factory.mktemp("adv_state")))
    comps = adversarial()
    res = stack.score_step({"name": "augment", "prompt": PROMPT, "base_prompt": BASE,
                            "completions": list(comps.values())}, save=False)
    return stack, list(comps), list(comps.values()), res


def _check(name: str, scored, reference, *, truncated=None) -> int:  # noqa: ANN001
    """Compare every scored value of `name` with `reference(c)` (ok) or `truncated(c)`; returns
    how many were compared."""
    stack, labels, comps, res = scored
    n = 0
    for label, c, v, st in zip(labels, comps, res.raw[name], res.model_statuses[name]):
        assert st in Status.SCORED, (name, label, st)
        assert math.isfinite(v), (name, label, v)
        ref_fn = reference if st == Status.OK else truncated
        if ref_fn is None:
            continue
        ref = ref_fn(c)
        if ref is None:
            continue
        assert close(v, ref, 1e-4), (name, label, st, v, ref)
        n += 1
    return n


def test_dpo(scored) -> None:  # noqa: ANN001
    stack = scored[0]
    sc = stack.scorers["dpo_reward_model"]

    def ref(c: str) -> float | None:
        if len(sc.tokenizer(PROMPT + c).input_ids) > DPO_REFERENCE_TOKENS:
            return None
        return reference_dpo(sc.model, sc.tokenizer, PROMPT, c)

    assert _check("dpo_reward_model", scored, ref) >= 5
    raw = dict(zip(scored[1], scored[3].raw["dpo_reward_model"]))
    assert raw["tiny"] == -11.0  # the reference's fallback for 5 characters or fewer


def test_openassistant(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["rlhf_reward_model"]
    ok = lambda c: ref_openassistant(sc.model, sc.tokenizer, PROMPT, c)  # noqa: E731
    cut = lambda c: ref_openassistant(sc.model, sc.tokenizer, PROMPT, c, truncation="only_second", max_length=512)  # noqa: E731
    assert _check("rlhf_reward_model", scored, ok, truncated=cut) == len(scored[1])
    assert scored[3].model_statuses["rlhf_reward_model"][0] == Status.TRUNCATED


def test_reciprocate(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["reciprocate_reward_model"]
    assert "token_type_ids" in sc.tokenizer("x")  # the stand-in tokenizer emits them

    def ref(c: str) -> float:  # the reference passes every tokenizer output: model(**inputs)
        message = f"<|prompter|>{PROMPT}</s><|assistant|>{c}</s><|endoftext|>"
        inputs = sc.tokenizer(message, return_tensors="pt", truncation=True)
        with torch.no_grad():
            return float(sc.model(**inputs).logits[0])

    # Truncation to the tokenizer's maximum is the reference's own rule: both statuses compare.
    assert _check("reciprocate_reward_model", scored, ref, truncated=ref) == len(scored[1])


def test_reciprocate_token_types_matter(scored) -> None:  # noqa: ANN001
    """Dropping the token types would change the score, so the test above can fail."""
    sc = scored[0].scorers["reciprocate_reward_model"]
    inputs = sc.tokenizer(f"<|prompter|>{PROMPT}</s><|assistant|>fine</s><|endoftext|>", return_tensors="pt")
    with torch.no_grad():
        full = float(sc.model(**inputs).logits[0])
        ids_only = float(sc.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits[0])
    assert not close(full, ids_only, 1e-3)


def test_dahoas(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["dahoas_reward_model"]
    ref = lambda c: reference_dahoas(sc.body, sc.head, sc.tokenizer, PROMPT, c)  # noqa: E731
    assert _check("dahoas_reward_model", scored, ref) >= 5


def test_nsfw(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["nsfw_filter"]
    ref = lambda c: ref_nsfw(sc.model, sc.tokenizer, c)  # noqa: E731
    assert _check("nsfw_filter", scored, ref) == len(scored[1])


def test_relevance(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["relevance_filter"]
    comps = scored[2]
    pairs = ref_relevance_scores(sc.first.model, sc.first.tokenizer, sc.second.model, sc.second.tokenizer, BASE, comps)
    refs = dict(zip(comps, (ref_relevance_mask(p, sc.bounds) for p in pairs)))
    assert _check("relevance_filter", scored, lambda c: refs[c]) == len(comps)


def test_diversity(scored) -> None:  # noqa: ANN001
    sc = scored[0].scorers["diversity_reward_model"]
    comps = scored[2]
    refs = dict(zip(comps, RefDiversity(sc.embedder.model, sc.embedder.tokenizer).score(comps)))
    assert _check("diversity_reward_model", scored, lambda c: refs[c]) == len(comps)


def test_rule_masks(scored) -> None:  # noqa: ANN001
    """The rule masks on the same completions: the spec's rules, literally."""
    _, labels, comps, res = scored
    answer_kw = ("Answer:", "Response:", "A:", "Completion:")
    question_kw = ("Question:", "Query:", "Q:")
    for c, v in zip(comps, res.raw["task_validator_filter"]):  # an augment (summary) step
        bad = any(k.lower() in c.lower() for k in answer_kw + question_kw)
        assert v == (0.0 if bad else 1.0)
    blacklist = dict(zip(labels, res.raw["blacklist_filter"]))
    assert blacklist["stock_phrase"] == 0.0 and blacklist["base_prompt"] == 0.0
    assert all(v == 1.0 for label, v in blacklist.items() if label not in ("stock_phrase", "base_prompt"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reciprocate_small_vocab_both_dtypes(tmp_path: Path, dtype: str) -> None:
    """Reciprocate's family in float32 and float16 against `model(**inputs)` in the same dtype, on a
    tokenizer that emits token types: repetition, and inputs past the 1,024-token maximum."""
    from causal_fixtures import make_runtime, model_config
    from rewardstack._scorers import reciprocate
    from rewardstack._scorers.base import ScoreRequest
    from small_models import make_small_gptj_classifier

    folder = tmp_path / "rec"
    make_small_gptj_classifier(folder, max_length=1024)
    sc = reciprocate.build(model_config("reciprocate_reward_model", folder, {"path": "rec", "dtype": dtype},
                                        options={"calibration_length": 64}), make_runtime())
    assert sc.model.dtype == getattr(torch, dtype)
    comps = [" the" * 700, " reward" * 300, text(random.Random(3), 6000), "ok", " yes no" * 100]
    res = sc.score(ScoreRequest(PROMPT, comps))
    tol = 1e-4 if dtype == "float32" else 2e-3
    for c, v, st in zip(comps, res.scores, res.statuses):
        inputs = sc.tokenizer(reciprocate.TEMPLATE.format(prompt=PROMPT, completion=c), return_tensors="pt", truncation=True)
        assert "token_type_ids" in inputs
        with torch.no_grad():
            ref = float(sc.model(**inputs).logits[0])
        assert st in Status.SCORED and close(v, ref, tol), (dtype, c[:20], v, ref)
    assert Status.TRUNCATED in res.statuses
