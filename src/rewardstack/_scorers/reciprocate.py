"""Reciprocate reward (`reciprocate_reward_model`): a GPT-J sequence classifier's single logit.

Semantics (spec, "Reciprocate"): text `<|prompter|>{prompt}</s><|assistant|>{completion}</s><|endoftext|>`
tokenized with truncation to the tokenizer's max length; the score is the logit that
GPTJForSequenceClassification reports for that one unpadded input: the one at the rightmost token
that is not the pad token (position 0 if every token is pad; the last if no pad token is set).

How: the step's texts share `<|prompter|>{prompt}...`, so the common token prefix runs once
(`prefix.py`) and the suffixes run in batches; the classifier's `score` layer is applied only to
each input's chosen position.
"""

from __future__ import annotations

from rewardstack.config import ModelConfig
from rewardstack._scorers.base import Runtime, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.causal import CausalScorer
from rewardstack._scorers.kvcache import choose_path
from rewardstack._scorers.encoding import head_for_tokens, sane_max_length
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._memory.costmodel import PADDING_SLACK
from rewardstack._scorers.prefix import PrefixRunner, run_in_groups, split_prefix
from rewardstack._models import RECIPROCATE

TEMPLATE = "<|prompter|>{prompt}</s><|assistant|>{completion}</s><|endoftext|>"


def read_position(ids: list[int], pad_id: int | None) -> int:
    """Where GPTJForSequenceClassification reads a single unpadded input's logit."""
    if pad_id is None:
        return len(ids) - 1
    for j in range(len(ids) - 1, -1, -1):
        if ids[j] != pad_id:
            return j
    return 0  # argmax over an all-zero mask


def tokenize_bounded(tokenizer, texts: list[str], max_len: int) -> tuple[list[list[int]], list[bool], list[list[int]] | None]:  # noqa: ANN001
    """Token ids with truncation to `max_len` (the tokenizer's own rule), whether each was cut, and
    the token_type_ids the tokenizer returns with them (None if it returns none).

    One tokenizer call: a fast tokenizer asked for its overflow gives each text's truncated row
    first and one more row per overflow, so "cut" is "has a second row". (A fast tokenizer
    encodes the whole text even when truncating, so this costs what the truncated call costs; the
    earlier way encoded a long text three times: truncated, untruncated, and for its types.)

    The types matter: the reference calls `model(**tokenizer(message, ...))`, so whatever types the
    tokenizer emits reach the model (GPT-J adds their embedding). GPT-J's own tokenizer emits none.
    """
    want_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
    texts = [head_for_tokens(t, tokenizer, max_len) for t in texts]  # same first ids, bounded work
    enc = tokenizer(texts, truncation=True, max_length=max_len, return_overflowing_tokens=True,
                    return_token_type_ids=want_types)
    owner = enc.get("overflow_to_sample_mapping")
    if owner is None:  # a slow tokenizer: no row mapping; truncate, then re-check the rows at the bound
        enc = tokenizer(texts, truncation=True, max_length=max_len, return_token_type_ids=want_types)
        ids = [list(x) for x in enc["input_ids"]]
        cut = [False] * len(texts)
        long = [k for k, x in enumerate(ids) if len(x) >= max_len]
        if long:
            for k, f in zip(long, tokenizer([texts[k] for k in long]).input_ids):
                cut[k] = len(f) > max_len
        types = enc.get("token_type_ids") if want_types else None
        return ids, cut, [list(t) for t in types] if types is not None else None
    owner = list(owner)
    first = [owner.index(k) for k in range(len(texts))]  # each text's truncated row
    cut = [owner.count(k) > 1 for k in range(len(texts))]
    types = enc.get("token_type_ids") if want_types else None
    return [list(enc["input_ids"][r]) for r in first], cut, [list(types[r]) for r in first] if types is not None else None


class ReciprocateScorer(CausalScorer):
    """GPT-J reward classifier with the Open Assistant prompt format."""

    name = RECIPROCATE.name

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        from transformers import AutoModelForSequenceClassification

        super().__init__(cfg, runtime)
        self.tokenizer, self.model = self._pretrained(AutoModelForSequenceClassification)
        self.body = self.model.base_model
        self.head = self.model.score
        conf = self.model.config
        # The tokenizer's bound, but never past the positions the model has (GPT-J: 2048).
        self.max_len = min(sane_max_length(self.tokenizer, conf, cfg.max_length), int(getattr(conf, "n_positions", 1 << 30)))
        self.pad_id = conf.pad_token_id
        self.fill_id = int(self.pad_id if self.pad_id is not None else 0)
        self.vocab = int(conf.vocab_size)
        self.use_prefix = choose_path(self.name, self.body, self.vocab, wanted=cfg.options.shared_prefix)
        self._calibrate(max_batch=16, prefixed=True, max_tokens=4 * self.calib_len)

    def _score_live(self, request: ScoreRequest, live: list[int], res: ScoreResult) -> ScoreResult:
        texts = [TEMPLATE.format(prompt=request.prompt, completion=request.completions[i]) for i in live]
        ids, cut, types = tokenize_bounded(self.tokenizer, texts, self.max_len)

        def inputs(allowance: Allowance) -> Pass:
            """The inputs within what the budget allows: over its cap, keep the start (not the spec's number)."""
            cap = allowance.cap
            for k, i in enumerate(live):
                if cut[k] or len(ids[k]) > cap:
                    res.statuses[i] = Status.TRUNCATED
                ids[k] = ids[k][:cap]
                if types is not None:
                    types[k] = types[k][:cap]
            pos = [read_position(x, self.pad_id) for x in ids]
            prefix, _ = split_prefix(ids, self.use_prefix)
            # The prefix must not reach the read position, which has to be in the suffix pass.
            prefix = prefix[: min(pos + [len(prefix)])]
            if types is not None:  # the prefix must share its token types too
                while prefix and any(t[: len(prefix)] != types[0][: len(prefix)] for t in types):
                    prefix = prefix[:-1]
            runner = PrefixRunner(self.body, prefix, pad_id=self.fill_id,
                                  prefix_types=types[0][: len(prefix)] if types is not None else None)
            lengths = [len(x) for x in ids]

            def forward(batch: list[int]) -> list[float]:
                return run_in_groups(batch, lengths, lambda sel: self._forward(
                    runner, [ids[j] for j in sel], [pos[j] for j in sel],
                    [types[j] for j in sel] if types is not None else None))

            return Pass(lengths, forward, max_batch=self.max_batch, prepare=runner.state, slack=PADDING_SLACK,
                        prefix=runner.length, completions=live)

        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=self.max_len)
        return self._fill(res, live, outcomes, float)


build = ReciprocateScorer
"""The registry's builder: the Reciprocate scorer for a GPT-J sequence-classification checkpoint."""
