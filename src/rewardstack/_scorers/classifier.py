"""Sequence-classifier scorers: the OpenAssistant reward model and the NSFW mask.

OpenAssistant (`rlhf_reward_model`): the single logit of DeBERTa-v3 on the (prompt, completion)
text pair. Unlike the reference, the pair is bounded to the model's trained length (512 tokens, or
`max_length` in the config): the completion side is cut (`only_second`, from its end), so the whole
prompt and the start of the completion are kept; only a prompt that alone fills the bound is cut
too (`longest_first`). A cut input gets `Status.TRUNCATED`.

NSFW (`nsfw_filter`): the completion's ids (special tokens on, no truncation) cut into windows of
512, every window scored alone as the spec says, but all windows of all completions in shared
padded passes. Mask 0 if some window's `max(-not_hate, hate)` > -0.5, else 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rewardstack.config import ModelConfig
from rewardstack._hub import load_source
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.encoding import head_for_tokens
from rewardstack._models import NSFW, OPENASSISTANT

OA_TRAINED_LENGTH = 512
NSFW_WINDOW = 512
NSFW_THRESHOLD = -0.5


def first_logit(out: Any, mask: torch.Tensor) -> torch.Tensor:
    return out.logits[:, 0]


def hate_value(out: Any, mask: torch.Tensor) -> torch.Tensor:
    # Chunk value of the spec: max(-not_hate, hate).
    return torch.maximum(-out.logits[:, 0], out.logits[:, 1])


class _Classifier(Scorer):
    """Tokenizer + sequence-classification model + the settings both scorers share."""

    def __init__(self, name: str, cfg: ModelConfig, runtime: Runtime, default_length: int | None) -> None:
        from transformers import AutoModelForSequenceClassification

        assert cfg.path, f"{name}: no path"
        self.name = name
        self.runtime = runtime
        self.cfg = cfg
        source, how = load_source(cfg, str(cfg.path))  # locked commit, remote code only if allowed
        self.tokenizer, self.model = runtime.models.pretrained(source, AutoModelForSequenceClassification, dtype=cfg.dtype, **how)
        self.max_length = enc.resolve_max_length(self.tokenizer, self.model.config, cfg.max_length, default_length)
        self.max_tokens = cfg.options.max_batch_tokens or enc.default_pass_tokens(self.max_length, runtime.device)
        self.max_batch = cfg.batch_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def _calibrate(self, head: Any) -> None:
        token = min(1000, self.model.config.vocab_size - 1)
        tuned = self.cfg.options.max_batch_tokens is None  # a size set in the config is kept

        def set_pass_tokens(n: int) -> None:
            self.max_tokens = n

        enc.calibrate(self.runtime, self.name, self.model, head, self.max_length, token,
                      pass_tokens=self.max_tokens, set_pass_tokens=set_pass_tokens if tuned else None)


class OpenAssistantScorer(_Classifier):
    """`rlhf_reward_model`: DeBERTa-v3 reward on the (prompt, completion) pair, bounded length."""

    kind = "reward"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        super().__init__(OPENASSISTANT.name, cfg, runtime, OA_TRAINED_LENGTH)
        self._calibrate(first_logit)

    def encode(self, prompt: str, texts: list[str], bound: int) -> tuple[list[list[int]], list[list[int]] | None, list[bool]]:
        """Pair ids (and token types) per text, cut to `bound`; and whether each was cut."""
        tok = self.tokenizer
        # Only the first `bound` ids of the pair are kept: read each completion up to a head that
        # provably gives those ids (scorers/encoding.py, head_for_tokens), not the whole text.
        texts = [head_for_tokens(t, tok, bound) for t in texts]
        full = tok([prompt] * len(texts), texts)
        ids, types = list(full["input_ids"]), full.get("token_type_ids")
        types = list(types) if types is not None else None
        if "" in texts:
            # The reference calls tokenizer(prompt, completion) per completion, and an empty
            # completion is no pair there: just the prompt, without a second separator.
            alone = tok(prompt)
            for j in (j for j, t in enumerate(texts) if t == ""):
                ids[j] = alone["input_ids"]
                if types is not None:
                    types[j] = alone["token_type_ids"]
        cut = [len(r) > bound for r in ids]
        long = [j for j, c in enumerate(cut) if c]
        if long:
            prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
            # Keep the prompt whole when it leaves room for at least one completion token.
            strategy = "only_second" if prompt_len + tok.num_special_tokens_to_add(pair=True) < bound else "longest_first"
            short = tok([prompt] * len(long), [texts[j] for j in long], truncation=strategy, max_length=bound)
            for k, j in enumerate(long):
                ids[j] = short["input_ids"][k]
                if types is not None:
                    types[j] = short["token_type_ids"][k]
        return ids, types, cut

    def score(self, request: ScoreRequest) -> ScoreResult:
        result = ScoreResult.failed_only(request)
        live = request.live()
        if not live:
            return result
        texts = list(dict.fromkeys(request.completions[i] for i in live))  # identical texts scored once
        first = enc.first_completion(request.completions, live)
        cut: list[bool] = []
        failed: list[Exception] = []

        def inputs(allowance: Allowance) -> Pass:
            """The texts encoded within the bound the budget allows (their `cut` flags kept)."""
            try:
                bound = min(self.max_length, allowance.cap)
                ids, types, cut[:] = self.encode(request.prompt, texts, bound)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - a tokenizer failure must not take the step down
                failed.append(e)
                return Pass([], lambda idx: [])
            return enc.rows_pass(self.model, ids, first_logit, pad_id=self.pad_id, types=types, max_tokens=self.max_tokens,
                                 max_batch=self.max_batch, completions=[first[t] for t in texts])

        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=self.max_length)
        if failed:
            for i in live:
                result.statuses[i] = Status.ERROR
            return result
        by_text = {t: (o, c) for t, o, c in zip(texts, outcomes, cut)}
        for i in live:
            o, c = by_text[request.completions[i]]  # type: ignore[index]
            if o.status != Status.OK:
                result.statuses[i] = o.status
                continue
            result.scores[i] = float(o.value)
            result.statuses[i] = Status.TRUNCATED if c else Status.OK
        return result


class NSFWMask(_Classifier):
    """`nsfw_filter`: hate-speech classifier over 512-id windows of the completion."""

    kind = "mask"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        super().__init__(NSFW.name, cfg, runtime, None)
        # The spec's window is 512 ids; an explicit max_length (or a shorter model) changes it.
        self.window = int(cfg.max_length) if cfg.max_length else min(NSFW_WINDOW, self.max_length)
        self.max_length = self.window
        self.max_tokens = cfg.options.max_batch_tokens or enc.default_pass_tokens(self.window, runtime.device)
        self._calibrate(hate_value)

    def score(self, request: ScoreRequest) -> ScoreResult:
        result = ScoreResult.failed_only(request)
        live = request.live()
        if not live:
            return result
        texts = list(dict.fromkeys(request.completions[i] for i in live))
        try:
            all_ids = self.tokenizer(texts)["input_ids"]
        except Exception:  # noqa: BLE001
            for i in live:
                result.statuses[i] = Status.ERROR
            return result
        first = enc.first_completion(request.completions, live)
        owner: list[int] = []
        width = self.window

        def inputs(allowance: Allowance) -> Pass:
            """The ids in windows the budget holds: one that cannot hold a whole window re-cuts the ids
            into shorter windows (TRUNCATED)."""
            nonlocal width
            width = min(self.window, allowance.cap)
            rows: list[list[int]] = []
            for t, ids in enumerate(all_ids):
                for start in range(0, max(len(ids), 1), width):
                    rows.append(list(ids[start : start + width]))
                    owner.append(t)
            return enc.rows_pass(self.model, rows, hate_value, pad_id=self.pad_id, max_tokens=self.max_tokens,
                                 max_batch=self.max_batch, completions=[first[texts[t]] for t in owner])

        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=self.window)
        worst = [-math.inf] * len(texts)
        status = [Status.OK] * len(texts)
        for t, o in zip(owner, outcomes):
            if o.status != Status.OK:
                status[t] = Status.worst([status[t], o.status])
            else:
                worst[t] = max(worst[t], float(o.value))
        recut = width < self.window
        by_text = {}
        for t, text in enumerate(texts):
            if status[t] != Status.OK:
                by_text[text] = (math.nan, status[t])
            else:
                st = Status.TRUNCATED if recut and len(all_ids[t]) > width else Status.OK
                by_text[text] = (0.0 if worst[t] > NSFW_THRESHOLD else 1.0, st)
        for i in live:
            result.scores[i], result.statuses[i] = by_text[request.completions[i]]  # type: ignore[index]
        return result


def build_openassistant(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    """The `rlhf_reward_model` scorer."""
    return OpenAssistantScorer(cfg, runtime)


def build_nsfw(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    """The `nsfw_filter` mask."""
    return NSFWMask(cfg, runtime)
