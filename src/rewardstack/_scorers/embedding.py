"""Embedding masks: relevance (`relevance_filter`) and diversity (`diversity_reward_model`).

Relevance runs two encoders in order. Model 1 (bert-base-uncased) embeds a text as the mean of its
L2-normalized, mean-pooled overflow windows; score = -RMS(completion - base prompt), bound -0.0246.
Model 2 (all-mpnet-base-v2) embeds the truncated text, mean-pooled and L2-normalized; score =
|cos(base prompt, completion)|, bound 0.3. A completion below model 1's bound is 0 and never sent
to model 2. Diversity uses model 2's embeddings: a batch part (nearest other completion) times a
history part (nearest stored past embedding), the history persisted through `state_dict`.

Embedding is shared: an `Embedder` per (checkpoint, dtype, length) lives in `runtime.options`, and
its bounded cache means the base prompt and each completion are embedded once per step, even by the
two masks that use the same checkpoint. Each call embeds every missing text of the step together.
Deviations from the reference: failed completions (None) are left out of the batch part and the
history; a step with a single live completion gets batch part 1 (no other completion to be near;
the reference raises); status TRUNCATED only where the budget cut below the spec's length.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from rewardstack.config import ModelConfig
from rewardstack._hub import load_source
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.encoding import head_for_tokens
from rewardstack._models import DIVERSITY, RELEVANCE

log = logging.getLogger("rewardstack.embedding")

HISTORY_SKIP = 500  # the oldest rows the history part ignores
HISTORY_MAX = 15_500
CACHE_ENTRIES = 1024  # ~3 MB of 768-d vectors: several steps of prompt + 50 completions

Embedding = tuple["torch.Tensor | None", str]  # (vector on CPU, status)


class EmbeddingCache(OrderedDict):
    """A bounded LRU of text embeddings, keyed by (embedder key, length used, text digest): an
    `OrderedDict`, least recently used first, whose `get` and `put` keep that order."""

    def get(self, key: tuple) -> Embedding | None:  # type: ignore[override]
        hit = super().get(key)
        if hit is not None:
            self.move_to_end(key)
        return hit

    def put(self, key: tuple, value: Embedding) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > CACHE_ENTRIES:
            self.popitem(last=False)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def pooled(out: Any, mask: torch.Tensor) -> torch.Tensor:
    # Mean-pool over the attention mask (the sentence-transformers pooling), then L2-normalize per
    # row (a window for model 1, a whole text for model 2).
    m = mask.unsqueeze(-1).to(out[0].dtype)
    return F.normalize((out[0] * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)


class Embedder:
    """One encoder checkpoint: windowed (relevance model 1) or truncated (model 2, diversity)."""

    def __init__(self, runtime: Runtime, cfg: ModelConfig, path: str, *, windowed: bool, name: str) -> None:
        from transformers import AutoModel

        source, how = load_source(cfg, path)  # a locked commit's snapshot, or the hub id as given
        revision, pass_tokens = how.get("revision"), cfg.options.max_batch_tokens
        self.runtime, self.windowed, self.name = runtime, windowed, name
        self.key = (source, cfg.dtype, revision, windowed)
        self.tokenizer, self.model = runtime.models.pretrained(source, AutoModel, dtype=cfg.dtype, revision=revision)
        self.max_length = enc.resolve_max_length(self.tokenizer, self.model.config, cfg.max_length)
        self.max_tokens = pass_tokens or enc.default_pass_tokens(self.max_length, runtime.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.cache: EmbeddingCache = runtime.options.setdefault("embedding_cache", EmbeddingCache())
        enc.calibrate(self, pooled, tune=pass_tokens is None)  # a size set in the config is kept

    @classmethod
    def shared(cls, runtime: Runtime, path: str, cfg: ModelConfig, *, windowed: bool, name: str) -> "Embedder":
        """The embedder for this checkpoint, built once per runtime (relevance and diversity share)."""
        pool = runtime.options.setdefault("embedders", {})
        key = (path, cfg.dtype, cfg.revision, windowed, cfg.max_length)
        if key not in pool:
            pool[key] = cls(runtime, cfg, path, windowed=windowed, name=name)
        return pool[key]

    def embed(self, texts: list[str], completions: Sequence[int | None] | None = None) -> list[Embedding]:
        """One (vector, status) per text; texts already embedded at this length come from the cache.
        `completions`: the step's completion index of each text (None: the prompt), for the telemetry."""
        label_of = dict(zip(reversed(texts), reversed(list(completions)))) if completions is not None else None  # first wins
        todo: list[Any] = []  # (key, text) of each text not cached at the length the budget allows
        found: dict[tuple, Embedding | None] = {}
        rows: list[list[int]] | None = []
        owner: list[int] = []
        keys: list[tuple] = []
        length = self.max_length

        def inputs(allowance: Allowance) -> Pass:
            """The texts not cached at the length the budget allows, as rows of at most that length."""
            nonlocal rows, length
            length = min(self.max_length, allowance.cap)
            keys[:] = [(self.key, length, _digest(t)) for t in texts]
            found.update({k: self.cache.get(k) for k in keys})
            todo.extend((k, t) for k, t in dict(zip(keys, texts)).items() if found[k] is None)
            rows, types = self._rows([t for _, t in todo], length, owner) if todo else ([], None)
            labels = [label_of[todo[t][1]] for t in owner] if label_of is not None else None
            return enc.rows_pass(self.model, rows or [], pooled, pad_id=self.pad_id, types=types, max_tokens=self.max_tokens,
                                 completions=labels)

        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=self.max_length)
        for (k, _), value in zip(todo, self._combine(len(todo), length, rows, owner, outcomes)):
            found[k] = value
            if value[1] in Status.SCORED:  # failures are retried next time, not cached
                self.cache.put(k, value)
        return [found[k] for k in keys]  # type: ignore[misc]

    def _rows(self, texts: list[str], length: int, owner: list[int]) -> tuple[list[list[int]] | None, list | None]:
        """Token-id rows of `texts` at `length` (and their token types), each row's text in `owner`;
        None when the tokenizer failed (the texts fail, not the step)."""
        try:
            if self.windowed:
                # Overflow windows of `length` (length - 2 content tokens each), no stride.
                encd = self.tokenizer(texts, truncation=True, max_length=length, return_overflowing_tokens=True)
                owner.extend(encd["overflow_to_sample_mapping"])
            else:  # the first `length` ids only: read a head that provably gives them (encoding.py, head_for_tokens)
                encd = self.tokenizer([head_for_tokens(t, self.tokenizer, length) for t in texts], truncation=True,
                                      max_length=length)
                owner.extend(range(len(texts)))
        except Exception as e:  # noqa: BLE001 - a tokenizer failure fails the texts, not the step
            log.error("%s: tokenizer failed: %s", self.name, e)
            return None, None
        types = encd.get("token_type_ids")
        return list(encd["input_ids"]), list(types) if types is not None else None

    def _combine(self, n: int, length: int, rows: list[list[int]] | None, owner: list[int],
                 outcomes: Sequence[Any]) -> list[Embedding]:
        """Each of `n` texts' embedding: the mean of its rows' vectors, with the worst row's status."""
        if rows is None:
            return [(None, Status.ERROR)] * n
        # The budget cut below the spec's length: a full row may have lost tokens.
        cut = length < self.max_length
        parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        statuses: list[list[str]] = [[] for _ in range(n)]
        for t, row, o in zip(owner, rows, outcomes):
            statuses[t].append(Status.TRUNCATED if o.status == Status.OK and cut and len(row) >= length else o.status)
            if o.status == Status.OK:
                parts[t].append(o.value)
        worst = [Status.worst(st) for st in statuses]  # of its windows
        # A scored text's vector: the mean of its window vectors, not re-normalized (one window: itself).
        return [(torch.stack(p).mean(0) if st in Status.SCORED else None, st) for p, st in zip(parts, worst)]


def relevance_similarity(prompt_vec: torch.Tensor, vec: torch.Tensor) -> float:
    """Relevance model 2's score: |cosine(base prompt embedding, completion embedding)|."""
    return abs(float(F.cosine_similarity(prompt_vec, vec, dim=0)))


class RelevanceMask(Scorer):
    """`relevance_filter`: both encoders must find the completion close to the base prompt."""

    name = RELEVANCE.name
    kind = "mask"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        if len(cfg.paths) != 2:
            raise ValueError(f"{self.name} takes exactly two embedding models")
        self.bounds = tuple(cfg.options.bounds)
        self.first = Embedder.shared(runtime, cfg.paths[0], cfg, windowed=True, name=f"{self.name}[0]")
        self.second = Embedder.shared(runtime, cfg.paths[1], cfg, windowed=False, name=f"{self.name}[1]")

    def modules(self) -> list[torch.nn.Module]:
        return [self.first.model, self.second.model]

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        # Model 1 (-RMS of the difference), then model 2 (|cos|) on what passed model 1's bound; the base
        # prompt is embedded once per step, in the same passes as the completions.
        stages = [(self.first, lambda p, v: -float(((v - p) ** 2).mean().sqrt())), (self.second, relevance_similarity)]
        passing = list(live)
        for (embedder, value), bound in zip(stages, self.bounds):
            if not passing:
                break
            texts: list[str] = [request.completions[i] for i in passing]  # type: ignore[misc]
            (p, ps), *e = embedder.embed([request.prompt] + texts, [None, *passing])
            kept = []
            for i, (v, st) in zip(passing, e):
                if p is None or v is None:
                    result.statuses[i] = ps if p is None else st
                    continue
                result.statuses[i] = Status.worst([result.statuses[i], ps, st])
                if value(p, v) < bound:
                    result.scores[i] = 0.0  # stop: a later model never sees it
                else:
                    kept.append(i)
            passing = kept
        for i in passing:
            result.scores[i] = 1.0
        return result


def _second_smallest(dist: torch.Tensor) -> torch.Tensor:
    return torch.topk(dist, 2, dim=1, largest=False).values[:, -1]


class DiversityHistory:
    """Diversity's state and its stateful half: the past embeddings, and the mask from new ones.

    `DiversityMask.stateless_part` (the forward pass) gives one embedding per completion;
    `score` turns them into the mask values against this history and appends them. The stack's
    stateful part (`rewardstack.stack.RewardState`) holds one per namespace.
    """

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None  # CPU float32, oldest first

    def score(self, request: ScoreRequest, embeddings: list[Embedding]) -> ScoreResult:
        """The mask of `request` from its live completions' `embeddings`, then remember them."""
        result = ScoreResult.failed_only(request)
        live = request.live()
        if not live:
            return result
        if len(embeddings) != len(live):
            raise ValueError(f"{len(embeddings)} embeddings for {len(live)} live completions")
        ok = [(i, v, st) for i, (v, st) in zip(live, embeddings) if v is not None]
        for i, (v, st) in zip(live, embeddings):
            if v is None:
                result.statuses[i] = st
        if not ok:
            return result
        e = torch.stack([v for _, v, _ in ok]).float()
        values = self._batch_part(e)
        hist = self._history_part(e)
        if hist is not None:
            values = values * hist
        for (i, _, st), x in zip(ok, values.tolist()):
            result.scores[i], result.statuses[i] = float(x), st
        self._append(e)
        return result

    @staticmethod
    def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T

    def _batch_part(self, e: torch.Tensor) -> torch.Tensor:
        if e.shape[0] < 2:
            return torch.ones(e.shape[0])  # no other completion to be close to
        x = _second_smallest(1 - self._cos(e, e).abs())  # self included: the 2nd is the nearest other
        return 1 / (1 + torch.exp(-40 * x + 4))

    def _history_part(self, e: torch.Tensor) -> torch.Tensor | None:
        h = self.history
        if h is None or h.shape[0] < HISTORY_SKIP + 2 or h.shape[1] != e.shape[1]:
            return None
        x = _second_smallest(1 - self._cos(e, h[HISTORY_SKIP:]).abs())
        return 1 / (1 + torch.exp(-1000 * x + 50))

    def _append(self, e: torch.Tensor) -> None:
        keep = [0] + [j for j in range(1, e.shape[0]) if not torch.equal(e[j], e[j - 1])]
        new = e[keep]
        if self.history is not None and self.history.shape[1] != new.shape[1]:
            log.warning("diversity history has dimension %d, model %d: history dropped",
                        self.history.shape[1], new.shape[1])
            self.history = None
        h = new if self.history is None else torch.cat([self.history, new])
        self.history = h[-HISTORY_MAX:].clone()

    def state_dict(self) -> dict[str, Any]:
        if self.history is None:
            return {}
        return {"history": self.history.detach().cpu().contiguous()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        h = state.get("history") if state else None
        if h is None:
            self.history = None
            return
        t = torch.as_tensor(h, dtype=torch.float32).cpu()
        self.history = t[-HISTORY_MAX:].clone() if t.ndim == 2 and t.shape[0] > 0 else None


class DiversityMask(DiversityHistory, Scorer):
    """`diversity_reward_model`: far from the other completions and from recent history.

    Split in two for the stack: `stateless_part` is the forward pass (the embeddings),
    `DiversityHistory.score` the stateful rest (the stack runs it on the history it keeps). Used
    alone, the scorer is its own `DiversityHistory`: its `history`, `state_dict` and `load_state_dict`.
    """

    name = DIVERSITY.name
    kind = "mask"
    stateful = True

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        assert cfg.path, f"{self.name}: no path"
        super().__init__()
        self.embedder = Embedder.shared(runtime, cfg.path, cfg, windowed=False, name=self.name)

    def modules(self) -> list[torch.nn.Module]:
        return [self.embedder.model]

    def stateless_part(self, request: ScoreRequest) -> list[Embedding]:
        """One (vector, status) per live completion: everything diversity needs a model for."""
        live = request.live()
        if not live:
            return []
        return self.embedder.embed([request.completions[i] for i in live], live)  # type: ignore[misc]

    def score(self, request: ScoreRequest) -> ScoreResult:  # type: ignore[override] - the Scorer's score
        return DiversityHistory.score(self, request, self.stateless_part(request))


build_relevance = RelevanceMask
"""The registry's builder of the `relevance_filter` mask."""
build_diversity = DiversityMask
"""The registry's builder of the `diversity_reward_model` mask."""
