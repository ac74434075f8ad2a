"""DPO reward (`dpo_reward_model`): mean log-probability of the completion under a reference LM.

Semantics (spec, "DPO"): -11 for a completion of 5 characters or fewer, for a prompt of max_len
tokens or more, and for a NaN/inf result; ids = tokenize(prompt + completion) cut to max_len; rows
P-1 .. len-2 scored; rows from P+1 on get the repetition penalty 1.2^c for every token seen c times
in ids[P:i]; log-softmax; mean.

How, without the reference's full [L, V] logits and per-position Python loop: the body runs once
per batch (the step's common token prefix once, via `prefix.py`), then the scored rows' hidden
states are projected to logits into one reused [chunk, V] float32 buffer, at most `logits_chunk`
rows at a time (the fastest chunk up to that cap is measured at load). Within a chunk, the penalty
touches only the columns of tokens the chunk's sequences have seen: per-row counts are the counts
carried from earlier chunks (a dense [B, V] int32 table) plus a segmented cumulative sum of one-hot
source tokens over just those columns; the penalized values are scattered back, the target logit
is read, and the row's log-sum-exp is taken in place (exp and sum only when the logits are
provably bounded). Memory is bounded by chunk x vocabulary, not by sequence x vocabulary.

Numerics follow the reference in the dtype the model runs in (float16 on a GPU): the penalized
logit and each row's log-probability are rounded to the logits' dtype and the per-sequence sum
accumulates in float32 and is rounded to that dtype, so a long, repetitive completion overflows to
-inf and scores -11 exactly where the reference's does. Only the log-sum-exp is taken in float32
(the reference's float16 `log_softmax` also reduces in float32 internally; docs/SEMANTICS.md).

The parts: `dpo_numerics.py` (the head, the penalty, the log-sum-exp: the number), `dpo_chunks.py`
(the logits chunk and attention block a pass runs with, from the budget), `attention.py` (BTLM's
attention in blocks of query rows, verified at load), `encoding.py` (the input bound); this module
scores requests.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from rewardstack.config import ModelConfig
from rewardstack._models import DPO
from rewardstack._scorers.attention import install as install_attention
from rewardstack._scorers.base import Runtime, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.causal import CausalScorer
from rewardstack._scorers.encoding import head_for_tokens, pad_rows, sane_max_length
from rewardstack._scorers.dpo_chunks import ChunkPolicy
from rewardstack._scorers.dpo_numerics import (  # noqa: F401 - re-exported: the scorer's numerics
    LOW, PENALTY, SAFE_EXP, LogitHead, PenaltyShapes, chunked_logprobs, logits_scale)
from rewardstack._scorers.kvcache import choose_path
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._memory.costmodel import PADDING_SLACK
from rewardstack._scorers.prefix import PrefixRunner, model_device, run_in_groups, split_prefix

# The numerics are re-exported: callers (the simulation, the GPU check, tests) name them `dpo.X`.
__all__ = ["LOW", "PENALTY", "SAFE_EXP", "LogitHead", "PenaltyShapes", "chunked_logprobs", "logits_scale",
           "DpoScorer", "build"]


class DpoScorer(CausalScorer):
    """The DPO reference-model log-probability reward."""

    name = DPO.name

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(cfg, runtime)
        self.tokenizer, self.model = self._pretrained(AutoModelForCausalLM)
        self.body = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.scale = logits_scale(self.model)
        self.max_len = sane_max_length(self.tokenizer, self.model.config, cfg.max_length)
        opts = cfg.options
        self.vocab = int(self.lm_head.weight.shape[0])
        self.logit_head = LogitHead(self.lm_head, self.scale)
        # The shared prefix needs cache objects: a legacy-cache model runs full sequences.
        self.use_prefix = choose_path(self.name, self.body, self.vocab, wanted=opts.shared_prefix)
        # Models whose own attention builds [heads, L, L] scores (BTLM's ALiBi) run it in blocks of
        # query rows when the load probe agrees (`attention.install`); `attention = "own"` opts out.
        self.attention = install_attention(self.name, self.body, rows=opts.attention_block, vocab=self.vocab,
                                           wanted=opts.attention != "own")
        pad = self.tokenizer.pad_token_id
        self.fill_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        # logits_chunk bounds the [rows, V] buffer (memory); within it the fastest row count is
        # measured at load (on CPU a cache-sized chunk is ~4x faster than 512 rows). `tune` runs with
        # the calibration (on the device the model runs on now: placement may have moved it), or the
        # calibration cache gives the chunk it found before; a tight budget may lower both knobs per call.
        self.chunks = ChunkPolicy(self.name, runtime.memory, self._dummy, max_chunk=opts.logits_chunk,
                                  calib_len=self.calib_len, attention=self.attention)
        self._calibrate(max_batch=16, prefixed=True, chunk=self.chunks.chunk, chunk_rows=True,
                        tune=(lambda: self.chunks.tune(self.logit_head)) if opts.tune_logits_chunk else None,
                        apply=self.chunks.apply, then=self.chunks.measure_for_budget)

    def attention_info(self) -> str:
        return self.attention.describe()

    def _profile_forward(self, runner: PrefixRunner, ids: list[list[int]]) -> list[float]:
        # The shared prefix is the prompt (not scored), as a step's prompt is its completions'
        # shared prefix: every row after it is scored (after the first token without a prefix).
        return self._forward(runner, ids, [max(1, runner.length)] * len(ids))

    def _forward(self, runner: PrefixRunner, ids: Sequence[list[int]], plens: Sequence[int]) -> list[float]:
        """Scores of sequences `ids` (full ids, prefix included) run against the runner's prefix."""
        device = model_device(self.model)
        h, _ = runner.run([x[runner.length :] for x in ids])
        n = torch.tensor([len(x) for x in ids], device=device)
        padded = pad_rows(ids, self.fill_id)[0]
        hidden_at = lambda s, p: runner.rows(h, s, p)  # noqa: E731
        out = chunked_logprobs(
            hidden_at, self.logit_head, padded.to(device), torch.tensor(list(plens), device=device), n,
            self.chunks.chunk,
        )
        return out.tolist()

    def _score_live(self, request: ScoreRequest, live: list[int], res: ScoreResult) -> ScoreResult:
        todo = []
        for i in live:
            c = request.completions[i]
            if c.strip() == "" or len(c) <= 5:  # type: ignore[union-attr]
                res.scores[i] = LOW
            else:
                todo.append(i)
        if not todo:
            return res
        p = len(self.tokenizer(request.prompt).input_ids)
        if p >= self.max_len:
            for i in todo:
                res.scores[i] = LOW
            return res
        # Only the first max_len ids are kept: read a head that provably gives them (encoding.py, head_for_tokens).
        enc = self.tokenizer([head_for_tokens(request.prompt + request.completions[i], self.tokenizer, self.max_len)  # type: ignore[operator]
                              for i in todo]).input_ids
        keep: list[int] = []

        def inputs(allowance: Allowance) -> Pass:
            """The inputs within what the budget allows: cut to its cap, at its chunk setting."""
            self.chunks.use(allowance.setting)
            cap = min(self.max_len, allowance.cap)
            ids: list[list[int]] = []
            for i, x in zip(todo, enc):
                if len(x) > cap:  # past the bound, or past what the budget holds (not the spec's number)
                    res.statuses[i] = Status.TRUNCATED
                if cap <= p < len(x):
                    # The budget cannot hold one completion token after the prompt: not scored (a -11
                    # here would be our budget's number, not the spec's, and would enter the statistics).
                    res.statuses[i] = Status.OOM
                    continue
                x = x[:cap]
                if len(x) <= p:  # no scored row: the reference's 0/0 = NaN gives -11
                    res.scores[i] = LOW
                    continue
                ids.append(x)
                keep.append(i)
            prefix, _ = split_prefix(ids, self.use_prefix)
            runner = PrefixRunner(self.body, prefix, pad_id=self.fill_id)
            lengths = [len(x) for x in ids]

            def forward(batch: list[int]) -> list[float]:
                return run_in_groups(batch, lengths,
                                     lambda sel: self._forward(runner, [ids[j] for j in sel], [p] * len(sel)))

            # The cost model's prefix: profiled as shared tokens that are also unscored prompt rows, so
            # never more than the prompt (rows past it are scored even where completions share them).
            return Pass(lengths, forward, max_batch=self.max_batch, prepare=runner.state, slack=PADDING_SLACK,
                        prefix=min(runner.length, p), completions=keep)

        longest = min(self.max_len, max(len(x) for x in enc))
        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=longest, settings=list(self.chunks.names))
        return self._fill(res, keep, outcomes, _finite_or_low)


def _finite_or_low(value: float) -> float:
    """A sequence's score: the reference's NaN or inf result scores -11."""
    v = float(value)
    return v if math.isfinite(v) else LOW


build = DpoScorer
"""The registry's builder: the DPO scorer for a causal LM checkpoint."""
