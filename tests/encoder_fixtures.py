"""Helpers for the encoder-scorer tests: stand-in folders, runtimes, configs, random texts, and
literal per-completion reference implementations of the spec (one forward pass per completion,
written to read like openvalidators 1.2.0), which the batched scorers are checked against.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager
from rewardstack._scorers.base import Runtime
from rewardstack._scorers.loading import ModelCache
from rewardstack._standins import make_diversity_standin, make_nsfw_standin, make_openassistant_standin, make_relevance_standin
from tests.soak.synthetic import text

UNICODE = ["", " ", "東京 über naïve", "🙂🙂🙂", "данные λόγος ✓", "a", "\u200b\u00e9"]


def make_runtime(budget: int | None = None) -> Runtime:
    """A CPU runtime with an optional simulated activation budget."""
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(budget), models=ModelCache(cpu))


def make_standins(root: Path) -> dict[str, dict[str, Any]]:
    """Every encoder stand-in under `root`, as the make-standins command would lay them out."""
    return {
        "rlhf_reward_model": make_openassistant_standin(root / "rlhf_reward_model"),
        "nsfw_filter": make_nsfw_standin(root / "nsfw_filter"),
        "relevance_filter": make_relevance_standin(root / "relevance_filter"),
        "diversity_reward_model": make_diversity_standin(root / "diversity_reward_model"),
    }


def config(name: str, root: Path, entry: dict[str, Any], **extra: Any) -> ModelConfig:
    """The ModelConfig for a stand-in entry (paths relative to `root`)."""
    kw: dict[str, Any] = {"dtype": entry.get("dtype", "float32")}
    if "path" in entry:
        kw["path"] = str(root / entry["path"])
    if "paths" in entry:
        kw["paths"] = [str(root / p) for p in entry["paths"]]
    if name == "rlhf_reward_model":
        kw["weight"] = 1.0
    kw.update(extra)
    return ModelConfig(name=name, **kw)


def random_texts(seed: int, n: int, max_chars: int = 1500) -> list[str]:
    """Mixed lengths (mostly short, some long), empty strings and unicode."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        if k % 10 == 0:
            out.append(rng.choice(UNICODE))
        else:
            out.append(text(rng, min(max_chars, int(rng.lognormvariate(0, 1.0) * 150))))
    return out


def close(a: float, b: float, rel: float = 1e-4) -> bool:
    """Equal within `rel` relative (absolute near zero); NaN only equals NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


# -- literal references ---------------------------------------------------------------------

def ref_openassistant(model: Any, tok: Any, prompt: str, completion: str, **tok_kwargs: Any) -> float:
    """The spec: tokenize the pair, the score is the single logit (one pass per completion)."""
    with torch.no_grad():
        inputs = tok(prompt, completion, return_tensors="pt", **tok_kwargs)
        return float(model(**inputs).logits[0, 0])


def ref_nsfw(model: Any, tok: Any, completion: str, chunk: int = 512) -> float:
    """The spec: ids with special tokens, no truncation, chunks of 512 each scored alone."""
    with torch.no_grad():
        ids = tok(completion)["input_ids"]
        best = -math.inf
        for i in range(0, len(ids), chunk):
            not_hate, hate = model(torch.tensor([ids[i : i + chunk]])).logits[0].tolist()
            best = max(best, max(-not_hate, hate))
        return 0.0 if best > -0.5 else 1.0


def _mean_pool(out: Any, mask: torch.Tensor) -> torch.Tensor:
    emb = out[0]
    m = mask.unsqueeze(-1).expand(emb.size()).float()
    return torch.sum(emb * m, 1) / torch.clamp(m.sum(1), min=1e-9)


def ref_bert_embedding(model: Any, tok: Any, text_: str, max_length: int | None = None) -> torch.Tensor:
    """Relevance model 1: overflow windows, pooled, normalized per window, averaged."""
    kw = {"max_length": max_length} if max_length else {}
    enc = tok(text_, padding=True, truncation=True, return_overflowing_tokens=True, return_tensors="pt", **kw)
    enc.pop("overflow_to_sample_mapping")
    with torch.no_grad():
        out = model(**enc)
    emb = F.normalize(_mean_pool(out, enc["attention_mask"]), p=2, dim=1)
    return torch.mean(emb, dim=0)


def ref_mpnet_embedding(model: Any, tok: Any, texts: list[str], max_length: int | None = None) -> torch.Tensor:
    """Relevance model 2 / diversity: truncated, pooled, normalized."""
    kw = {"max_length": max_length} if max_length else {}
    enc = tok(texts, padding=True, truncation=True, return_tensors="pt", **kw)
    with torch.no_grad():
        out = model(**enc)
    return F.normalize(_mean_pool(out, enc["attention_mask"]), p=2, dim=1)


def ref_relevance_scores(m1: Any, t1: Any, m2: Any, t2: Any, prompt: str, completions: list[str],
                         max_length: int | None = None) -> list[tuple[float, float]]:
    """Model 1 and model 2 scores of the spec, one completion per pass (the prompt embedded once
    here only to keep the test fast; the reference re-embedded it, with the same result)."""
    p1 = ref_bert_embedding(m1, t1, prompt, max_length)
    p2 = ref_mpnet_embedding(m2, t2, [prompt], max_length)[0]
    out = []
    for c in completions:
        s1 = float(-(((ref_bert_embedding(m1, t1, c, max_length) - p1) ** 2).mean() ** 0.5))
        c2 = ref_mpnet_embedding(m2, t2, [c], max_length)[0]
        out.append((s1, abs(float(torch.dot(F.normalize(p2, dim=0), F.normalize(c2, dim=0))))))
    return out


def ref_relevance_mask(scores: tuple[float, float], bounds: tuple[float, float]) -> float:
    """The spec's rule: model 1 below its bound stops at 0; then model 2; else 1."""
    if scores[0] < bounds[0]:
        return 0.0
    return 0.0 if scores[1] < bounds[1] else 1.0


class RefDiversity:
    """The spec's diversity mask with its history, one completion embedded per pass."""

    def __init__(self, model: Any, tok: Any) -> None:
        self.model, self.tok = model, tok
        self.history = torch.zeros(0, 0)

    @staticmethod
    def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T

    def score(self, completions: list[str]) -> list[float]:
        if not completions:
            return []
        e = torch.cat([ref_mpnet_embedding(self.model, self.tok, [c]) for c in completions])
        batch = torch.topk(1 - self._cos(e, e).abs(), 2, largest=False).values[:, -1]
        rewards = 1 / (1 + torch.exp(-40 * batch + 4))
        if self.history.shape[0] >= 502:
            hist = torch.topk(1 - self._cos(e, self.history[500:]).abs(), 2, largest=False).values[:, -1]
            rewards = rewards * (1 / (1 + torch.exp(-1000 * hist + 50)))
        unique = [e[0]]
        for j in range(1, e.shape[0]):
            if not torch.all(torch.eq(e[j], e[j - 1])):
                unique.append(e[j])
        new = torch.stack(unique)
        self.history = new if self.history.numel() == 0 else torch.cat([self.history, new])
        self.history = self.history[-15500:]
        return rewards.tolist()


_BUILT: dict[str, tuple[Path, dict[str, dict[str, Any]]]] = {}


def standin_root(tmp_path_factory: Any) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The stand-ins, built once per test session (both encoder test files share them)."""
    if "root" not in _BUILT:
        root = tmp_path_factory.mktemp("encoder_standins")
        _BUILT["root"] = (root, make_standins(root))
    return _BUILT["root"]
