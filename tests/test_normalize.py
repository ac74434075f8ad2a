"""The running normalizer against a literal copy of the reference (torch, float32), edge cases included."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rewardstack._state import RunningNormalizer


class ReferenceNormalizer:
    """openvalidators 1.2.0 `BaseRewardModel.normalize_rewards`, as written there."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self.count_limit = 3000

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        new_count = rewards.numel()
        if 0 < new_count and 0 < self.count + new_count:
            new_mean = rewards.mean()
            new_var = rewards.var(dim=0)
            new_weight = new_count / (self.count + new_count)
            old_weight = self.count / (self.count + new_count)
            diff = new_mean - self.mean
            self.mean = new_weight * new_mean + old_weight * self.mean
            self.var = (new_weight * new_var) + (old_weight * self.var) + (new_weight * old_weight) * diff * diff
            self.count = min(self.count_limit, self.count + new_count)
        rewards = rewards - self.mean
        if self.var > 0:
            rewards /= torch.sqrt(self.var)
        return 0.5 * (1 + torch.erf(rewards / torch.sqrt(torch.tensor([2.0]))))


def test_matches_reference_over_many_steps() -> None:
    rng = random.Random(0)
    ours, ref = RunningNormalizer(), ReferenceNormalizer()
    for step in range(200):  # passes the count limit (3000) so the cap is exercised
        n = rng.randint(2, 50)
        raw = [rng.gauss(rng.uniform(-2, 2), rng.uniform(0.1, 3)) for _ in range(n)]
        got = ours(raw)
        want = ref(torch.tensor(raw, dtype=torch.float32)).tolist()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), step
    assert ours.count == 3000


def test_single_sample_has_zero_variance_not_nan() -> None:
    norm = RunningNormalizer()
    out = norm([0.7])
    assert norm.var == 0.0 and norm.count == 1 and norm.mean == pytest.approx(0.7)
    assert out == [0.5]  # z = 0 without division
    out = norm([0.1, 0.9])
    assert all(math.isfinite(x) for x in out) and math.isfinite(norm.var)


@pytest.mark.filterwarnings("ignore:var\\(\\)")  # the reference's own warning on one sample
def test_reference_carries_nan_after_single_sample() -> None:
    # The defect we fix: the reference's variance becomes NaN and stays NaN.
    ref = ReferenceNormalizer()
    ref(torch.tensor([0.7]))
    ref(torch.tensor([0.1, 0.9]))
    assert math.isnan(float(ref.var))


def test_nan_never_enters_statistics() -> None:
    a, b = RunningNormalizer(), RunningNormalizer()
    out_a = a([1.0, float("nan"), 3.0])
    out_b = b([1.0, 3.0])
    assert (a.count, a.mean, a.var) == (b.count, b.mean, b.var)
    assert out_a[1] == 0.0 and out_a[0] == out_b[0] and out_a[2] == out_b[1]


def test_empty_and_all_nan_leave_state_untouched() -> None:
    norm = RunningNormalizer()
    norm([1.0, 2.0])
    before = norm.to_dict()
    assert norm([]) == []
    assert norm([float("nan")] * 3) == [0.0, 0.0, 0.0]
    assert norm.to_dict() == before


def test_roundtrip_and_rejects_bad_state() -> None:
    norm = RunningNormalizer()
    norm([1.0, 2.0, 4.0])
    assert RunningNormalizer.from_dict(norm.to_dict()) == norm
    with pytest.raises(ValueError):
        RunningNormalizer.from_dict({"count": 1, "mean": 0.0, "var": float("nan")})
