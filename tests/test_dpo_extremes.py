"""DPO at the extremes: heavy repetition and the longest admitted length, in float32 and float16.

The reference (openvalidators 1.2.0) runs BTLM in float16 on a GPU. There the penalized logit
`x * 1.2^c` is computed in float32 and written back into the float16 logits, where anything past
65,504 becomes -inf; its float32 (float32 run) or float16 (float16 run) sum of per-token
log-probabilities overflows to -inf; and an infinite or NaN mean becomes -11. These tests run a
literal transcription of that code, in the same dtype as the scorer's model, on completions with a
token repeated 50, 500 and 5,000 times and on one cut at the model's 8,192-token maximum, and
require the same number (float32: 1e-4 relative; float16: 2e-3 relative) and -11 in exactly the
same cases.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime, reference_dpo
from rewardstack.config import ModelConfig
from rewardstack._scorers import dpo
from rewardstack._scorers.base import ScoreRequest, Status
from tests.soak.synthetic import text
from small_models import make_small_gpt2

MAX_LEN = 4096  # the stand-in's maximum (BTLM's is 8,192; the cut is the same code)
TOL = {"float32": 1e-4, "float16": 2e-3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("small") / "dpo"
    make_small_gpt2(f, MAX_LEN)
    return f


def build(folder: Path, dtype: str, **options: object) -> dpo.DpoScorer:
    opts = {"logits_chunk": 512, "tune_logits_chunk": False, "calibration_length": 128}
    opts.update(options)
    cfg = ModelConfig(name="dpo_reward_model", path=str(folder), weight=1.0, dtype=dtype, options=opts)
    return dpo.build(cfg, make_runtime())


PROMPT = "Summarize the text: the model answer question summary data memory budget token layer value."


def completions(tokenizer) -> dict[str, str]:  # noqa: ANN001
    rng = random.Random(17)
    words = "the model answer question summary".split()
    # The vocabulary's tokens in turn (those that tokenize back to themselves): no token is seen
    # more than ~30 times, so the penalty stays finite in float32 and so does the mean at the
    # longest admitted length.
    own = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids
           and tokenizer.decode([i]).isascii() and tokenizer(tokenizer.decode([i])).input_ids == [i]]
    cycle = tokenizer.decode(own * 18)
    return {
        "repeat50": " the" * 50,
        # Counts up to 476: every per-token log-probability is still finite in float32 (the
        # smallest is about -7e37), but their float32 sum passes 3.4e38 and overflows to -inf;
        # a float64 sum would give a mean of about -4e35 (the "-4.5e34" regime).
        "repeat476": " the" * 476,
        "repeat500": " the" * 500,
        "repeat5000": " the" * 5000,  # 10,000 tokens: cut at the maximum
        "longest": cycle,  # past the maximum: cut, scored at the longest admitted length
        # The case: 40,000 characters in which common words repeat hundreds of times.
        "common_words": " ".join(rng.choice(words) for _ in range(7_000))[:40_000],
        "mild": text(rng, 400),
    }


@pytest.fixture(scope="module", params=["float32", "float16"])
def outcome(request: pytest.FixtureRequest, folder: Path) -> tuple[str, dict[str, tuple[float, str, float, int]]]:
    """dtype and, per completion, (score, status, literal reference, token count)."""
    dtype = request.param
    sc = build(folder, dtype)
    # float16 really runs in float16 on CPU: weights and the logits the head produces.
    head_out = sc.model.get_output_embeddings()(torch.zeros(1, sc.model.config.n_embd, dtype=sc.model.dtype))
    assert sc.model.dtype == getattr(torch, dtype) and head_out.dtype == getattr(torch, dtype)
    assert sc.model(torch.tensor([[1, 2, 3]])).logits.dtype == getattr(torch, dtype)
    comps = completions(sc.tokenizer)
    names = list(comps)
    res = sc.score(ScoreRequest(PROMPT, [comps[n] for n in names]))
    out = {}
    for n, s, st in zip(names, res.scores, res.statuses):
        ref = reference_dpo(sc.model, sc.tokenizer, PROMPT, comps[n])
        out[n] = (s, st, float(ref), len(sc.tokenizer(PROMPT + comps[n]).input_ids))
    return dtype, out


def test_extremes_match_literal_reference(outcome: tuple[str, dict]) -> None:
    dtype, out = outcome
    assert out["longest"][3] > MAX_LEN and out["repeat5000"][3] > MAX_LEN
    for n, (s, st, ref, length) in out.items():
        assert st == (Status.TRUNCATED if length > MAX_LEN else Status.OK), n
        assert math.isfinite(s), n
        assert s == pytest.approx(ref, rel=TOL[dtype], abs=TOL[dtype]), (dtype, n, s, ref)
    # -11 in exactly the same cases.
    assert {n for n, v in out.items() if v[0] == -11.0} == {n for n, v in out.items() if v[2] == -11.0}


def test_the_regimes_are_reached(outcome: tuple[str, dict]) -> None:
    """Heavy repetition overflows to the reference's -11 in both dtypes; float16 saturates sooner
    (|x| * 1.2^50 passes 65,504) and its sum overflows on a long completion; float32 keeps a
    finite mean for the mild and the vocabulary-cycling completions."""
    dtype, out = outcome
    low = {n for n, v in out.items() if v[2] == -11.0}
    assert {"repeat500", "repeat5000", "common_words"} <= low and "mild" not in low
    if dtype == "float16":
        assert "repeat50" in low and "longest" in low
    else:
        assert "repeat50" not in low and "longest" not in low
        assert "repeat476" in low  # the float32 sum's overflow, not an infinite logit
        assert out["repeat50"][0] < -50  # the penalty's large finite value, equal to the reference's
