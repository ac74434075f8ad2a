"""Blocked ALiBi attention (`scorers/attention.py`) against the BTLM-like remote code's own attention.

At the reference's bound, 8,192 tokens, on a stand-in with one layer, one head and a 9,216-token
vocabulary (so the model's own attention, which holds `[1, 8192, 8192]` float32 scores, and the
head over every scored row run on CPU's two cores in seconds): DPO's scores with the
blocked attention equal those with the model's own within 1e-6 relative in float32 and within
docs/SEMANTICS.md's float16 tolerance (2e-3) in float16, on ordinary text and on heavy repetition.
The blocked attention is installed here without the load probe, so the comparison itself (not the
probe) decides; the probe has its own tests below. Memory under the tracker: one input's peak
grows linearly in length with blocks and quadratically with the model's own attention.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime
from rewardstack.config import ModelConfig
from rewardstack._memory.device import TensorBytesTracker
from rewardstack._scorers import attention, dpo
from rewardstack._scorers.prefix import PrefixRunner
from rewardstack._standins import make_btlm_checkpoint, make_dpo_standin
from tests.soak.synthetic import text

BOUND = 8192
TOL = {"float32": 1e-6, "float16": 2e-3}  # float16: docs/SEMANTICS.md's tolerance for scores


VOCAB = 9216  # >= 1,000 + BOUND: room for 8,192 distinct ids above the special tokens


@pytest.fixture(scope="module")
def long_btlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two heads (the probe test's multi-head model), the full BERT vocabulary."""
    return make_btlm_checkpoint(tmp_path_factory.mktemp("btlm8k") / "btlm", max_length=BOUND,
                           config_overrides={"n_layer": 1, "n_head": 2})


@pytest.fixture(scope="module")
def lean_btlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8,192-token comparisons' stand-in: one head and a 9,216-id vocabulary.

    At 8,192 tokens the time is the `[heads, L, L]` attention (each head's scores, mask, bias and
    softmax) and the head over ~8,100 scored rows x vocabulary; one head halves the first and the
    smaller vocabulary cuts the second by 3.3x. What is compared is unchanged: the blocked rows
    against the model's own at every position up to the bound. Splitting heads, and slopes per
    head, are checked on the two-head model by the load probe (`long_btlm`, the test after).
    """
    return make_btlm_checkpoint(tmp_path_factory.mktemp("btlm8k_lean") / "btlm", max_length=BOUND,
                                config_overrides={"n_layer": 1, "n_head": 1, "vocab_size": VOCAB})


def _cfg(folder: Path, dtype: str, **options: object) -> ModelConfig:
    return ModelConfig(name="dpo_reward_model", path=str(folder), weight=1.0, dtype=dtype, trust_remote_code=True,
                       options={"tune_logits_chunk": False, "calibration_length": 64, "max_batch": 1, **options})


def _rel(a: float, b: float) -> float:
    if a == b:  # also -inf == -inf: the overflow regime, -11 for both
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _long_inputs(sc: dpo.DpoScorer) -> list[tuple[list[int], int]]:
    """(ids, prompt length) of 8,192 tokens each, in the regimes a long DPO input reaches.

    - 8,192 distinct token ids, the last 600 scored: no penalty, so the score is the plain mean
      log-probability and moves with every scored row's hidden state, each attending to ~8,000
      keys (the sensitive case; 600 rows keep float16's sum below 65,504, so it is not -11);
    - a 7,592-token prompt and a completion cycling through 64 ids: each seen up to 9 times;
    - natural text after a short prompt: common tokens seen hundreds of times, whose penalized
      logits dominate the mean (float16: the sum overflows, -inf);
    - one word repeated: the penalized sum overflows, -inf (-11) in both (heavy repetition).

    The text's BERT ids (up to 29,730) are renamed one to one onto ids from 1,000 up, so they fit
    the stand-in's vocabulary: the same sequence of tokens (the same repeats, the same counts) under
    other names. The repeated word is named 1002, an id the stand-in's random head gives a negative
    logit, so its penalty multiplies toward -inf (as "again"'s id did on the 30,522-id stand-in):
    the overflow regime, which the test asserts.
    """
    rng = random.Random(19)
    scored = 600
    distinct = random.Random(5).sample(range(1000, sc.vocab), BOUND)
    cycle = distinct[: BOUND - scored] + [1000 + (i % 64) * 11 for i in range(scored)]
    out = [(distinct, BOUND - scored), (cycle, BOUND - scored)]
    prompt = sc.tokenizer(text(rng, 300)).input_ids
    names = {int(sc.tokenizer.convert_tokens_to_ids("again")): 1002}

    def rename(t: int) -> int:
        if t < 1000:  # special tokens keep their ids
            return t
        if t not in names:
            names[t] = next(k for k in range(1000, sc.vocab) if k not in names.values())
        return names[t]

    for c in (text(rng, 45000), "again " * 9000):
        ids = sc.tokenizer(sc.tokenizer.decode(prompt, skip_special_tokens=True) + c).input_ids[:BOUND]
        ids = [rename(t) for t in ids]
        assert max(ids) < sc.vocab
        out.append((ids, len(prompt)))
    assert all(len(x) == BOUND for x, _ in out)
    return out


def _scores(sc: dpo.DpoScorer, inputs: list[tuple[list[int], int]]) -> list[float]:
    # One input per pass (the model's own attention holds [1, 8192, 8192] float32 scores, 256 MiB
    # each); the scorer's path: full sequence (legacy cache), chunked logits and penalty.
    with torch.inference_mode():
        return [sc._forward(PrefixRunner(sc.body, [], pad_id=sc.fill_id), [ids], [p])[0] for ids, p in inputs]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16", marks=pytest.mark.slow)])
def test_blocked_equals_own_at_8192_tokens(lean_btlm: Path, dtype: str) -> None:
    sc = dpo.build(_cfg(lean_btlm, dtype, attention="own"), make_runtime())
    assert sc.attention.kind == "own"
    inputs = _long_inputs(sc)
    # Blocked first: its output buffer is then fresh memory, not the own pass's freed output
    # (which holds the right numbers and would hide a row that no block computed).
    choice = attention.install(sc.name, sc.body, rows=attention.ATTENTION_BLOCK, verify=False)
    assert choice.kind == "blocked" and choice.rows == 512  # 16 blocks of 512 query rows
    blocked = _scores(sc, inputs)
    choice.restore()
    own = _scores(sc, inputs)
    for k, (a, b) in enumerate(zip(own, blocked)):
        assert _rel(a, b) <= TOL[dtype], (dtype, k, a, b, _rel(a, b))
    print(dtype, "own", own, "blocked", blocked)
    assert -30 < own[0] < 0 and -30 < own[1] < 0  # the sensitive regimes are finite, not -11
    assert not math.isfinite(own[3]) or own[3] < -1e30  # heavy repetition: the overflow regime


def test_scorer_installs_blocked_attention_when_the_probe_agrees(long_btlm: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rewardstack.attention"):
        sc = dpo.build(_cfg(long_btlm, "float32"), make_runtime())
    assert sc.attention.kind == "blocked" and sc.attention.rows == attention.ATTENTION_BLOCK
    assert "probe agrees" in sc.attention.reason
    assert any("blocked ALiBi attention, 512-row query blocks" in r.getMessage() for r in caplog.records)
    assert "blocked ALiBi attention" in sc.attention_info()
    # The replacement adopts the original parameters: the state dict's names and tensors are unchanged.
    names = set(sc.model.state_dict())
    assert "transformer.h.0.attn.c_attn.weight" in names and not any("orig" in k for k in names)


class _ShiftedAlibi(torch.nn.Module):
    """Remote code whose ALiBi differs from the transcription: query i biased as if at i - 1.

    (A shift the other way changes every causal entry of a row by the same amount, which softmax
    cannot see; this one changes the diagonal's sign and is visible.)
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.slopes = inner.slopes

    def forward(self, seq_length: int, key_length: int) -> torch.Tensor:
        return self.inner(seq_length + 1, key_length + 1)[:, :-1, 1:]


def test_probe_keeps_the_models_own_attention_when_they_differ(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = make_btlm_checkpoint(tmp_path / "btlm", max_length=128)
    sc = dpo.build(_cfg(folder, "float32", attention="own"), make_runtime())
    sc.body.relative_pe = _ShiftedAlibi(sc.body.relative_pe)
    before = [type(b.attn) for b in sc.body.h]
    with caplog.at_level(logging.INFO, logger="rewardstack.attention"):
        choice = attention.install(sc.name, sc.body)
    assert choice.kind == "own" and "relative difference" in choice.reason  # numbers, not an exception
    assert isinstance(sc.body.relative_pe, _ShiftedAlibi) and [type(b.attn) for b in sc.body.h] == before  # put back
    assert any("differs" in r.getMessage() for r in caplog.records)


def test_models_without_alibi_keep_their_attention(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    entry = make_dpo_standin(folder, max_length=64)
    sc = dpo.build(ModelConfig(name="dpo_reward_model", path=str(folder), weight=1.0, dtype=entry["dtype"],
                               options={"tune_logits_chunk": False, "calibration_length": 32}), make_runtime())
    assert sc.attention.kind == "own" and "ALiBi" in sc.attention.reason


def _peak(sc: dpo.DpoScorer, length: int) -> int:
    """The tracked peak of one `length`-token DPO input, every row after the first scored.

    The ids cycle through 97 tokens, so the penalty's columns stay few (random ids would make
    its bookkeeping, linear in length too, the slow part of the test).
    """
    ids = [[1000 + i % 97 for i in range(length)]]
    tracker = TensorBytesTracker()
    with torch.inference_mode(), tracker.window("dpo") as w:
        sc._forward(PrefixRunner(sc.body, [], pad_id=sc.fill_id), ids, [1])  # the scoring path
    return w.peak_increase


@pytest.mark.slow
def test_peak_grows_linearly_with_blocks_and_quadratically_without(lean_btlm: Path) -> None:
    sc = dpo.build(_cfg(lean_btlm, "float32", attention="own"), make_runtime())
    own4, own8 = _peak(sc, 4096), _peak(sc, 8192)
    attention.install(sc.name, sc.body, verify=False)
    blk4, blk8 = _peak(sc, 4096), _peak(sc, 8192)
    assert blk8 <= 2.2 * blk4, (blk4, blk8)
    assert own8 >= 3.0 * own4, (own4, own8)
    assert own8 >= 4 * blk8  # [1, 8192, 8192] float32 scores are 256 MiB; the blocks 16 MiB
    print(f"peaks: own {own4} -> {own8} ({own8 / own4:.2f}x), blocked {blk4} -> {blk8} ({blk8 / blk4:.2f}x)")
