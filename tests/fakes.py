"""Deterministic fake scorers for stack tests: scores derived from the text, no model."""

from __future__ import annotations

import math
import zlib

from rewardstack.config import ModelConfig
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status


def text_score(name: str, text: str) -> float:
    """A stable pseudo-random score in [-3, 3) per (model, text)."""
    return (zlib.crc32(f"{name}|{text}".encode()) % 6000) / 1000.0 - 3.0


class FakeReward(Scorer):
    """Scores from a hash of the text; the text 'NAN' scores NaN, 'RAISE' makes the scorer raise."""

    kind = "reward"

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: ScoreRequest) -> ScoreResult:
        res = ScoreResult.failed_only(request)
        for i, c in enumerate(request.completions):
            if c is None:
                continue
            if c == "RAISE":
                raise RuntimeError("fake failure")
            res.scores[i] = math.nan if c == "NAN" else text_score(self.name, c)
        return res


class FakeMask(FakeReward):
    """1 unless the text contains 'bad'; 'OOM' gives an explicit oom status."""

    kind = "mask"

    def score(self, request: ScoreRequest) -> ScoreResult:
        res = ScoreResult.failed_only(request)
        for i, c in enumerate(request.completions):
            if c is None:
                continue
            if c == "OOM":
                res.statuses[i] = Status.OOM
                continue
            res.scores[i] = 0.0 if "bad" in c else 1.0
        return res


def build(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    return FakeReward(cfg.name) if cfg.is_reward else FakeMask(cfg.name)


class FakeRelevance(FakeReward):
    """A mask that reads its base prompt: 1 when the completion shares a word of 4+ letters with it."""

    kind = "mask"

    def score(self, request: ScoreRequest) -> ScoreResult:
        res = ScoreResult.failed_only(request)
        words = {w for w in request.prompt.lower().split() if len(w) > 3}
        for i, c in enumerate(request.completions):
            if c is not None:
                res.scores[i] = 1.0 if words & {w for w in c.lower().split() if len(w) > 3} else 0.0
        return res


def build_relevance(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    return FakeRelevance(cfg.name)


class FakeEmbeddings(FakeReward):
    """A stateful mask as diversity is one: its forward pass gives one vector per live completion
    (from the text's hash); the validator's state (`RewardState`'s diversity history) does the rest.
    Its own `score` must not run inside a stack, whose state is per validator, not per scorer."""

    kind = "mask"
    stateful = True

    def stateless_part(self, request: ScoreRequest) -> list[tuple[object, str]]:
        import torch

        return [(torch.tensor([text_score(self.name, c), 1.0 + len(c)]), Status.OK)
                for c in request.completions if c is not None]

    def score(self, request: ScoreRequest) -> ScoreResult:
        raise AssertionError(f"{self.name}: the stack ran the whole stateful scorer, not its stateless part")


def build_embeddings(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    return FakeEmbeddings(cfg.name)
