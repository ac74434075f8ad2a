"""DPO reward (`dpo_reward_model`): mean log-probability of the completion under a reference LM.

Semantics (spec, "DPO"): -11 for a completion of 5 characters or fewer, for a prompt of max_len
tokens or more, and for a NaN/inf result; ids = tokenize(prompt + completion) cut to max_len; rows
P-1 .. len-2 scored; rows from P+1 on get the repetition penalty 1.2^c for every token seen c times
in ids[P:i]; log-softmax; mean.

How, without the reference's full [L, V] logits and per-position Python loop: the body runs once
per batch (the step's common token prefix once, via `prefix.py`), then the scored rows' hidden
states are projected to logits `logits_chunk` rows at a time. Within a chunk, the penalty touches
only the columns of tokens the completion has seen: their per-row counts come from a (segmented)
cumulative sum of one-hot source tokens over just those columns; the penalized values are
scattered back and the row's log-sum-exp is taken over the modified chunk. Memory is bounded by
chunk x vocabulary, not by sequence x vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rewardstack.config import ModelConfig
from rewardstack.scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack.scorers.prefix import (
    PrefixRunner,
    model_device,
    padding_groups,
    save_standin_tokenizer,
    split_prefix,
)

LOW = -11.0  # exp(-11) is below 1/vocab: the spec's "worst" score
PENALTY = 1.2  # the CTRL paper's repetition penalty, as in the reference


def sane_max_length(tokenizer: Any, config: Any, override: int | None) -> int:
    """cfg.max_length, else the tokenizer's model_max_length if sane (<= 1e6), else the config's."""
    if override:
        return int(override)
    m = getattr(tokenizer, "model_max_length", None)
    if m is not None and m <= 1_000_000:
        return int(m)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(config, key, None)
        if v:
            return int(v)
    return 2048


def logits_scale(model: torch.nn.Module) -> float:
    """BTLM (muP) multiplies its head's logits by a constant outside the head; keep it."""
    return float(getattr(model, "output_logits_scale", 1.0) or 1.0)


def chunked_logprobs(
    hidden_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    lengths: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Mean penalized log-probability of rows P-1 .. n-2 of each sequence (float64, [B]).

    `ids` [B, N] padded token ids, `prompt_lens` P [B], `lengths` n [B] (every n > P).
    `hidden_at(seq, pos)` gives the body's last hidden states at those rows; `head` maps hidden
    states to (scaled) logits.
    """
    device = ids.device
    b = ids.shape[0]
    counts = lengths - prompt_lens  # rows per sequence: P-1 .. n-2
    seq = torch.repeat_interleave(torch.arange(b, device=device), counts)
    starts = torch.cumsum(counts, 0) - counts  # first flat row of each sequence
    pos = prompt_lens[seq] - 1 + (torch.arange(seq.numel(), device=device) - starts[seq])
    target = ids[seq, pos + 1]
    # Row i adds source token ids[i-1] to the seen counts once i-1 >= P (so ids[P:i] is counted).
    src = torch.where(pos - 1 >= prompt_lens[seq], ids[seq, (pos - 1).clamp(min=0)], -1)
    sums = torch.zeros(b, dtype=torch.float64, device=device)
    total = seq.numel()
    for c0 in range(0, total, chunk):  # loop over row chunks, not positions
        c1 = min(total, c0 + chunk)
        s_seq, s_src = seq[c0:c1], src[c0:c1]
        logits = head(hidden_at(s_seq, pos[c0:c1])).float()
        # Tokens seen before this chunk by the sequence that continues into it.
        first = int(s_seq[0])
        base_src = src[int(starts[first]) : c0]
        base_src = base_src[base_src >= 0]
        cols = torch.unique(torch.cat([base_src, s_src[s_src >= 0]]))
        if cols.numel():
            onehot = (s_src.unsqueeze(1) == cols.unsqueeze(0)).to(torch.int32)
            csum = torch.cat([onehot.new_zeros(1, cols.numel()), onehot.cumsum(0)])
            # Segmented cumsum: subtract what was counted before each row's sequence began.
            seg0 = (starts[s_seq] - c0).clamp(min=0)
            cnt = csum[1:] - csum[seg0]
            base = (base_src.unsqueeze(1) == cols.unsqueeze(0)).sum(0, dtype=torch.int32)
            cnt = cnt + (s_seq == first).to(torch.int32).unsqueeze(1) * base.unsqueeze(0)
            idx = cols.unsqueeze(0).expand(c1 - c0, -1)
            x = logits.gather(1, idx)
            f = torch.pow(torch.tensor(PENALTY, dtype=torch.float32, device=device), cnt.float())
            pen = torch.where(cnt > 0, torch.where(x < 0, x * f, x / f), x)
            logits.scatter_(1, idx, pen)
        lp = logits.gather(1, target[c0:c1].unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, 1)
        del logits
        sums.index_add_(0, s_seq, lp.double())
    return sums / counts.double()


class DpoScorer(Scorer):
    """The DPO reference-model log-probability reward."""

    name = "dpo_reward_model"
    kind = "reward"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg, self.runtime = cfg, runtime
        self.tokenizer = runtime.models.tokenizer(cfg.path, revision=cfg.revision)
        self.model = runtime.models.model(cfg.path, AutoModelForCausalLM, dtype=cfg.dtype, revision=cfg.revision)
        self.body = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.scale = logits_scale(self.model)
        self.max_len = sane_max_length(self.tokenizer, self.model.config, cfg.max_length)
        self.chunk = int(cfg.options.get("logits_chunk", 512))
        self.use_prefix = bool(cfg.options.get("shared_prefix", True))
        self.max_batch = cfg.batch_size or int(cfg.options.get("max_batch", 16))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        calib_len = min(self.max_len, int(cfg.options.get("calibration_length", 512)))
        runtime.memory.calibrate(self.name, self._dummy, max_length=calib_len, max_batch=4)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        return logits * self.scale if self.scale != 1.0 else logits

    def _dummy(self, b: int, length: int) -> None:
        """A profile pass: B random sequences of `length` tokens, all but the first row scored."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.lm_head.weight.shape[0], (b, length), generator=g).tolist()
        self._forward(PrefixRunner(self.body, [], pad_id=self.pad_id), ids, [1] * b)

    def _forward(self, runner: PrefixRunner, ids: Sequence[list[int]], plens: Sequence[int]) -> list[float]:
        """Scores of sequences `ids` (full ids, prefix included) run against the runner's prefix."""
        device = model_device(self.model)
        c = runner.length
        h, _ = runner.run([x[c:] for x in ids])
        n = torch.tensor([len(x) for x in ids], device=device)
        padded = torch.full((len(ids), int(n.max())), self.pad_id, dtype=torch.long)
        for k, x in enumerate(ids):
            padded[k, : len(x)] = torch.tensor(x)
        hidden_at = lambda s, p: runner.rows(h, s, p)  # noqa: E731
        out = chunked_logprobs(
            hidden_at, self._head, padded.to(device), torch.tensor(list(plens), device=device), n, self.chunk
        )
        return out.tolist()

    def score(self, request: ScoreRequest) -> ScoreResult:
        res = ScoreResult.failed_only(request)
        live = request.live()
        todo = []
        for i in live:
            c = request.completions[i]
            assert c is not None
            if c.strip() == "" or len(c) <= 5:
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
        enc = self.tokenizer([request.prompt + request.completions[i] for i in todo]).input_ids
        cap = min(self.max_len, self.runtime.memory.length_cap(self.name, self.max_len))
        ids: list[list[int]] = []
        keep: list[int] = []
        for i, x in zip(todo, enc):
            if len(x) > self.max_len:
                res.statuses[i] = Status.TRUNCATED
            if len(x) > cap:  # the budget cannot hold it whole: cut further (not the spec's number)
                res.statuses[i] = Status.TRUNCATED
            x = x[: min(self.max_len, cap)]
            if len(x) <= p:  # no scored row: the reference's 0/0 = NaN gives -11
                res.scores[i] = LOW
                continue
            ids.append(x)
            keep.append(i)
        if not keep:
            return res
        prefix, _ = split_prefix(ids, self.use_prefix)
        runner = PrefixRunner(self.body, prefix, pad_id=self.pad_id)

        def forward(batch: list[int]) -> list[float]:
            out: list[float] = [math.nan] * len(batch)
            for group in padding_groups([len(ids[j]) for j in batch]):
                vals = self._forward(runner, [ids[batch[g]] for g in group], [p] * len(group))
                for g, v in zip(group, vals):
                    out[g] = v
            return out

        outcomes = self.runtime.memory.run(self.name, [len(x) for x in ids], forward, max_batch=self.max_batch)
        for i, o in zip(keep, outcomes):
            if o.status != "ok":
                res.scores[i], res.statuses[i] = math.nan, o.status
            else:
                v = float(o.value)
                res.scores[i] = v if math.isfinite(v) else LOW
        return res


def build(cfg: ModelConfig, runtime: Runtime) -> Scorer:
    """The DPO scorer for `cfg` (a causal LM checkpoint)."""
    return DpoScorer(cfg, runtime)


def make_standin(folder: Path, *, max_length: int = 8192) -> dict:
    """A tiny random GPT-2-style LM (BTLM is GPT-2 based) with the real BERT tokenizer, 8k context."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_standin_tokenizer(folder, max_length)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(1234)
    GPT2LMHeadModel(config).save_pretrained(str(folder), safe_serialization=True)
    return {"path": folder.name, "dtype": "float32"}
