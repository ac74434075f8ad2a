"""A reward scorer with known memory behaviour, for the telemetry tests.

`HogScorer` runs every forward pass through the memory manager like the real scorers do, on a
plain tensor computation whose activations are exactly `BYTES_PER_TOKEN` per padded token, so the
simulated device sees a known peak. Class attributes switch on the behaviours under test:
`extra_on_call` (allocate `EXTRA_BYTES` more in that call only, 1-based), `leak_per_step` (keep
that many bytes on the device after every step), `max_batch` and `profile_in_step` (in that
score call, 1-based, ask the manager for a profile of `SLOW_SHAPES` at `SLOW_SECONDS` a shape
inside the step; the manager refuses it, counted in `refused`).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from rewardstack import config as config_mod
from conftest import use_builder
from rewardstack._memory import Profile
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status

SLOW_SECONDS = 0.1
SLOW_SHAPES = [(1, 8), (1, 16), (1, 32), (2, 32), (1, 64), (2, 64)]
BYTES_PER_TOKEN = 4096  # float32 x 1024 features
EXTRA_BYTES = 64 * 1024**2
CHARS_PER_TOKEN = 4


def tokens(text: str) -> int:
    """The fixture's 'tokenizer': one token per 4 characters, at least one."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


class HogScorer(Scorer):
    """See the module docstring."""

    kind = "reward"
    extra_on_call: int | None = None
    leak_per_step: int = 0
    max_batch: int | None = None
    profile_in_step: int | None = None

    def __init__(self, name: str, runtime: Runtime) -> None:
        self.name = name
        self.runtime = runtime
        self.calls = 0
        self.score_calls = 0
        self.refused = 0
        self.kept: list[torch.Tensor] = []
        self.passes: list[tuple[list[int], int]] = []  # (indices, padded length) of every pass it ran
        runtime.memory.calibrate(Profile(name, lambda b, n: self._pass(b, n), max_length=64,
                                 shapes=[(1, 8), (1, 32), (2, 16), (4, 32), (1, 64), (2, 64)]))

    @staticmethod
    def _pass(batch: int, length: int) -> torch.Tensor:
        x = torch.ones(batch, length, BYTES_PER_TOKEN // 4)
        return (x * 2).sum(dim=(1, 2))

    def score(self, request: ScoreRequest) -> ScoreResult:
        self.score_calls += 1
        if self.score_calls == self.profile_in_step:
            def slow(b: int, n: int) -> torch.Tensor:
                time.sleep(SLOW_SECONDS)
                return self._pass(b, n)

            try:
                self.runtime.memory.calibrate(Profile(f"{self.name}[slow]", slow, max_length=64, shapes=SLOW_SHAPES))
            except RuntimeError:  # no profile inside a request: the hog keeps its load-time cost model
                self.refused += 1
        res = ScoreResult.failed_only(request)
        live = request.live()
        lengths = [tokens(request.completions[i] or "") for i in live]

        def forward(idx: list[int]) -> list[float]:
            self.calls += 1
            self.passes.append((list(idx), max(lengths[i] for i in idx)))
            hog = None
            if self.calls == self.extra_on_call:  # held through the pass: the peak rises by exactly this
                hog = torch.empty(EXTRA_BYTES, dtype=torch.uint8)
                hog.fill_(1)
            out = self._pass(len(idx), max(lengths[i] for i in idx))
            del hog
            return [float(v) / 1e6 for v in out]

        outcomes = self.runtime.memory.run(self.name, lengths, forward, max_batch=self.max_batch, completions=live)
        for i, o in zip(live, outcomes):
            if o.status == Status.OK:
                res.scores[i] = o.value
            else:
                res.statuses[i] = o.status
        if self.leak_per_step:
            with self.runtime.memory.tracker:  # kept on the (simulated) device, never freed
                self.kept.append(torch.zeros(self.leak_per_step // 4))
        return res


def build_hog(cfg: config_mod.ModelConfig, runtime: Runtime) -> Scorer:
    """The registry's builder for the hog."""
    return HogScorer(cfg.name, runtime)


HOG = "rlhf_reward_model"  # the model slot the hog takes (a reward model with weight)


@pytest.fixture
def hog_config(tmp_path, fake_registry, monkeypatch):  # noqa: ANN001, ANN201
    """A CPU stack config: the hog as `rlhf_reward_model`, fakes for the other models."""
    use_builder(monkeypatch, HOG, "telemetry_fixtures:build_hog")
    for attr in ("extra_on_call", "leak_per_step", "max_batch", "profile_in_step"):
        monkeypatch.setattr(HogScorer, attr, getattr(HogScorer, attr))
    return lambda **top: config_mod.from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), **top})


def step(k: int, n: int = 4, chars: int = 64) -> dict:
    """A step of `n` completions of `chars` characters each (distinct texts)."""
    comps = [(f"completion {k}.{i} " + "lorem ipsum dolor sit amet " * 40)[:chars].strip() for i in range(n)]
    return {"name": "augment" if k % 4 == 0 else f"followup{k % 4}", "prompt": f"prompt {k}", "completions": comps}
