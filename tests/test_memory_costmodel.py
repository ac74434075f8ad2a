"""Tests of the cost model: exact recovery of synthetic terms, and fits within 15% on tiny real models."""

from __future__ import annotations

import pytest
import torch

from bench.common import check_cost_model
from memory_models import LOGIT_CHUNK, build
from rewardstack._memory.costmodel import CostModel, profile, profile_shapes
from rewardstack._memory import MemoryManager, Profile


def test_fit_recovers_all_six_terms() -> None:
    true = CostModel(a=1000, b=50, c=0.5, d=3000, e=7, f=0.25, g=40, chunk=128)
    samples = [(b, l, int(true.predict(b, l))) for b, l in profile_shapes(512, 8, chunk=128)]
    fit = CostModel(chunk=128).fit(samples)
    for b, l in [(1, 8), (3, 100), (7, 300), (8, 512)]:
        assert fit.predict(b, l) == pytest.approx(true.predict(b, l), rel=1e-3)
    assert min(fit.coefficients()) >= 0


def test_old_three_term_api_still_works() -> None:
    cm = CostModel(10.0, 2.0, 1.0)
    assert cm.predict(2, 3) == 10 + 2 * 6 + 1 * 18
    assert "B*L^2" in cm.describe() and set(cm.to_dict()) >= {"a", "b", "c", "trust", "samples"}


def test_fit_never_goes_negative_and_handles_one_batch_size() -> None:
    samples = [(1, l, 100 + 10 * l) for l in (8, 16, 64)]
    fit = CostModel().fit(samples)
    assert min(fit.coefficients()) >= 0 and fit.max_error() < 1e-6


def test_profile_skips_shapes_that_run_out_of_memory() -> None:
    def run(b: int, l: int) -> None:
        if b * l > 1000:
            raise torch.OutOfMemoryError("too big")

    cm = profile(run, lambda fn: (fn(), 0)[1] + 1, profile_shapes(512, 8))
    assert all(b * l <= 1000 for b, l, _ in cm.samples)


@pytest.mark.parametrize("family", ["deberta", "bert", "llama", "gptj"])
def test_fit_within_15_percent_on_tiny_models(family: str) -> None:
    _, run = build(family, hidden=32, layers=1)
    mm = MemoryManager(None)
    chunk = LOGIT_CHUNK if family == "llama" else None
    cm = mm.calibrate(Profile(family, run, max_length=256, max_batch=4, chunk=chunk))
    # Off-grid shapes inside the profiled range.
    for b, l in [(1, 24), (2, 50), (3, 100), (4, 180), (2, 256), (3, 200)]:
        measured = mm.measure(lambda: run(b, l))
        assert abs(cm.predict(b, l) - measured) / measured < 0.15, (family, b, l, measured, cm.describe())


def test_chunk_over_batch_rows_is_fitted() -> None:
    # DPO's logit buffer holds min(B*L, chunk) rows of the whole batch, not chunk rows per sequence.
    chunk = 128
    truth = lambda b, l: 5_000 + 300 * b * l + 120_000 * min(b * l, chunk) + 90_000 * b  # noqa: E731
    shapes = [(b, l) for b in (1, 2, 4) for l in (16, 64, 128, 256, 512)]
    samples = [(b, l, truth(b, l)) for b, l in shapes]
    cm = CostModel(chunk=chunk, chunk_rows=True).fit(samples)
    assert cm.max_error() < 0.01
    assert abs(cm.predict(8, 1000) - truth(8, 1000)) / truth(8, 1000) < 0.01
    per_sequence = CostModel(chunk=chunk).fit(samples)
    assert per_sequence.max_error() > 0.05  # the per-sequence form cannot express it


def test_a_peak_that_is_the_larger_of_two_phases_is_fitted_as_two_pieces() -> None:
    # DPO's pass peaks in its body (activations growing with B*L and L^2) or in its logits phase
    # after it (a flat chunk buffer, the seen-count table per row, the penalty's bookkeeping),
    # whichever is larger. The coefficients are the DPO stand-in's, as fitted from its profile.
    chunk = 128
    body = lambda b, l: 6_640 * b * l + 0.98 * l * l  # noqa: E731
    head = lambda b, l: 179 * b * l + 179_000 * b + 125_000 * min(b * l, chunk) + 52 * min(b * l, chunk) * max(0, l - chunk)  # noqa: E731
    truth = lambda b, l: max(body(b, l), head(b, l))  # noqa: E731
    samples = [(b, l, int(truth(b, l))) for b, l in profile_shapes(8192, 16, chunk=chunk, max_tokens=8192)]
    cm = CostModel(chunk=chunk, chunk_rows=True).fit(samples)
    assert cm.alt is not None and cm.max_error() < 0.01, cm.describe()
    for b, l in [(16, 100), (12, 300), (3, 700), (1, 6000), (5, 1500)]:  # off the grid
        assert abs(cm.predict(b, l) - truth(b, l)) / truth(b, l) < 0.02, (b, l, cm.predict(b, l), truth(b, l))
    again = CostModel.from_dict(cm.to_dict())  # the calibration cache keeps both pieces
    assert again.predict(12, 300) == cm.predict(12, 300)
    assert "where larger" in cm.describe()


def test_check_cost_model_measures_off_grid_shapes_with_the_profile_run() -> None:
    mm = MemoryManager(None)
    run = lambda b, l: torch.ones(b, l, l).softmax(-1).sum()  # noqa: E731
    mm.calibrate(Profile("attn", run, max_length=128, max_batch=4))
    rows = check_cost_model(mm, "attn", [(3, 50), (5, 100)])
    assert [(b, l) for b, l, _, _ in rows] == [(3, 50), (5, 100)]
    for _, _, predicted, measured in rows:
        assert measured > 0 and abs(predicted - measured) / measured < 0.15
