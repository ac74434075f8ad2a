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
from rewardstack._memory.guard import Outcome
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status, fill
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

    def __init__(self, name: str, cfg: ModelConfig, runtime: Runtime, default_length: int | None,
                 tokenizer_options: dict[str, Any] | None = None) -> None:
        from transformers import AutoModelForSequenceClassification

        assert cfg.path, f"{name}: no path"
        self.name = name
        self.runtime = runtime
        self.cfg = cfg
        source, how = load_source(cfg, str(cfg.path))  # locked commit, remote code only if allowed
        self.tokenizer, self.model = runtime.models.pretrained(source, AutoModelForSequenceClassification, dtype=cfg.dtype,
                                                               tokenizer_options=tokenizer_options, **how)
        self.max_length = enc.resolve_max_length(self.tokenizer, self.model.config, cfg.max_length, default_length)
        self.max_tokens = cfg.options.max_batch_tokens or enc.default_pass_tokens(self.max_length, runtime.device)
        self.max_batch = cfg.batch_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


class OpenAssistantScorer(_Classifier):
    """`rlhf_reward_model`: DeBERTa-v3 reward on the (prompt, completion) pair, bounded length."""

    kind = "reward"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        super().__init__(OPENASSISTANT.name, cfg, runtime, OA_TRAINED_LENGTH)
        enc.calibrate(self, first_logit, tune=cfg.options.max_batch_tokens is None)  # a size set in the config is kept

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

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        texts = list(dict.fromkeys(request.completions[i] for i in live))  # identical texts scored once
        # Each text's first completion index: the telemetry names its row by it.
        first = {request.completions[i]: i for i in reversed(live)}
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
            return ScoreResult.failed_only(request, Status.ERROR)
        ks = [texts.index(request.completions[i]) for i in live]  # type: ignore[arg-type]
        return fill(result, live, [outcomes[k] for k in ks], float, cut=[cut[k] for k in ks])


class NSFWMask(_Classifier):
    """`nsfw_filter`: hate-speech classifier over 512-id windows of the completion."""

    kind = "mask"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        super().__init__(NSFW.name, cfg, runtime, None)
        # The spec's window is 512 ids; an explicit max_length (or a shorter model) changes it.
        self.max_length = self.window = int(cfg.max_length) if cfg.max_length else min(NSFW_WINDOW, self.max_length)
        self.max_tokens = cfg.options.max_batch_tokens or enc.default_pass_tokens(self.window, runtime.device)
        enc.calibrate(self, hate_value, tune=cfg.options.max_batch_tokens is None)

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        texts = list(dict.fromkeys(request.completions[i] for i in live))
        try:
            all_ids = self.tokenizer(texts)["input_ids"]
        except Exception:  # noqa: BLE001
            return ScoreResult.failed_only(request, Status.ERROR)
        first = {request.completions[i]: i for i in reversed(live)}  # each text's first completion
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
        recut = width < self.window  # the budget re-cut the windows: a longer text lost its whole-window reading
        ks = [texts.index(request.completions[i]) for i in live]  # type: ignore[arg-type]
        masks = [Outcome(0.0 if worst[t] > NSFW_THRESHOLD else 1.0, status[t]) for t in ks]
        return fill(result, live, masks, float, cut=[recut and len(all_ids[t]) > width for t in ks])


build_openassistant = OpenAssistantScorer
"""The registry's builder of the `rlhf_reward_model` scorer."""
build_nsfw = NSFWMask
"""The registry's builder of the `nsfw_filter` mask."""
