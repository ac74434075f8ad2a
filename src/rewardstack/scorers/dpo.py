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
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rewardstack.config import ModelConfig
from rewardstack.hub import load_source
from rewardstack.memory.costmodel import CostModel
from rewardstack.models import DPO
from rewardstack.scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack.scorers.kvcache import choose_path
from rewardstack.scorers.prefix import (
    dummy_ids,
    PrefixRunner,
    model_device,
    profile_runner,
    run_in_groups,
    save_standin_tokenizer,
    split_prefix,
)

LOW = -11.0  # exp(-11) is below 1/vocab: the spec's "worst" score
PENALTY = 1.2  # the CTRL paper's repetition penalty, as in the reference

log = logging.getLogger(__name__)


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


SAFE_EXP = 60.0  # |logit| <= 60: exp() neither overflows (even summed over 2^30 columns) nor underflows


class LogitHead:
    """Writes the head's (scaled) float32 logits for hidden rows into a reused buffer.

    float32 weights: one matrix product straight into the buffer (no fresh [r, V] tensor per
    chunk: on CPU a fresh tensor of tens of MB is a new mapping and its page faults). Other dtypes:
    the head and the scale in its own dtype (as the model computes them), then widened into the
    buffer, so every unpenalized value is exactly one of the model's own logits.

    `bound(h)` is a proven upper bound of max |logit| per row (Cauchy-Schwarz:
    |scale| * (||h|| * max_v ||W_v|| + max |b|)); when it is at most SAFE_EXP the log-sum-exp
    needs no max-shift, which saves two of its four passes over the chunk.
    """

    def __init__(self, lm_head: torch.nn.Module, scale: float) -> None:
        self.weight = lm_head.weight
        self.bias = getattr(lm_head, "bias", None)
        self.scale = float(scale)
        self.vocab = int(self.weight.shape[0])
        self.dtype = self.weight.dtype  # the logits' dtype: the penalty and the sum round to it
        w = self.weight.detach().float()
        self._wmax = float(w.norm(dim=1).max())
        self._bmax = float(self.bias.detach().float().abs().max()) if self.bias is not None else 0.0
        del w

    def __call__(self, h: torch.Tensor, out: torch.Tensor) -> None:
        w = self.weight
        if w.dtype == torch.float32 and h.dtype == torch.float32:
            if self.bias is None:
                torch.mm(h, w.t(), out=out)
            else:
                torch.addmm(self.bias, h, w.t(), out=out)
            if self.scale != 1.0:
                out.mul_(self.scale)
        else:  # the head and its scale in the head's dtype, as the model's forward computes them
            y = torch.nn.functional.linear(h.to(w.dtype), w, self.bias)
            out.copy_(y * self.scale if self.scale != 1.0 else y)

    def bound(self, h: torch.Tensor) -> float:
        """An upper bound of |logit| over the rows `h` (before any penalty, which only lowers it)."""
        return abs(self.scale) * (float(h.float().norm(dim=1).max()) * self._wmax + self._bmax)


def lse_inplace(logits: torch.Tensor, bounded: bool) -> torch.Tensor:
    """Row log-sum-exp of `logits` [r, V] float32, overwriting it. `bounded`: |x| <= SAFE_EXP known.

    Unbounded: max, subtract, exp, sum (the usual shift). Bounded: exp and sum only; the shift
    only guards against overflow, which the bound rules out (and every unpenalized column is at
    least -SAFE_EXP, so the sum cannot underflow to 0), so both give the same number up to float32
    rounding. NaN hidden states make the bound NaN, hence unbounded: NaN flows through to -11.
    """
    if bounded:
        return logits.exp_().sum(1).log_()
    m = logits.amax(1, keepdim=True)
    logits.sub_(m).exp_()
    return logits.sum(1).log_().add_(m.squeeze(1))


class PenaltyValues:
    """The steps of `chunked_logprobs` whose sizes depend on token values, read from the values.

    `PenaltyShapes` is the same interface in shape-only mode: the simulation
    (`rewardstack.planning.simulate`) runs `chunked_logprobs` on meta tensors, which hold no
    values, so that the scorer's own bookkeeping is what it measures (a change here changes the
    simulated peak; there is no second copy of this function).
    """

    def rows(self, counts: torch.Tensor) -> torch.Tensor:
        """The sequence of each scored row (`repeat_interleave(arange(B), counts)`)."""
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def sequences(self, s_seq: torch.Tensor, c0: int) -> torch.Tensor:
        """The sequences of a chunk's rows (rows are grouped by sequence)."""
        return torch.unique_consecutive(s_seq)

    def select(self, t: torch.Tensor, valid: torch.Tensor, c0: int) -> torch.Tensor:
        """`t[valid]`: the chunk's rows whose source token is counted."""
        return t[valid]

    def columns(self, mark: torch.Tensor, c0: int) -> torch.Tensor:
        """The vocabulary columns the chunk penalizes (`mark.nonzero()`)."""
        return mark.nonzero().squeeze(1)

    def bounded(self, head: "LogitHead", h: torch.Tensor) -> bool:
        """Whether |logit| <= SAFE_EXP is proven for the rows `h`."""
        return head.bound(h) <= SAFE_EXP

    def any(self, valid: torch.Tensor, c0: int) -> bool:
        """Whether any of the chunk's rows has a counted source token."""
        return bool(valid.any())


class PenaltyShapes(PenaltyValues):
    """`chunked_logprobs` in shape-only mode: sizes from the rows per sequence, known on the host.

    Where values would decide a size it is bounded: a chunk penalizes at most one column per token
    seen so far (every scored token distinct), and the logits are taken as bounded (the cheaper
    log-sum-exp path has the same peak). The bound's own temporaries are still allocated.
    """

    def __init__(self, counts: Sequence[int], vocab: int, chunk: int) -> None:
        self.counts = [int(c) for c in counts]
        self.vocab = int(vocab)
        self.chunk = int(chunk)
        self.seq_of = [s for s, c in enumerate(self.counts) for _ in range(c)]
        self.starts = [sum(self.counts[:s]) for s in range(len(self.counts))]
        self.done = [0] * len(self.counts)  # scored rows per sequence before the chunk

    def _chunk(self, c0: int) -> list[int]:
        return self.seq_of[c0:c0 + self.chunk]

    def _nvalid(self, c0: int) -> int:
        # Rows whose source token is counted (pos - 1 >= P): all but each sequence's first two.
        return sum(1 for k in range(c0, c0 + len(self._chunk(c0))) if k - self.starts[self.seq_of[k]] >= 2)

    def rows(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.empty(sum(self.counts), dtype=torch.long, device=counts.device)

    def sequences(self, s_seq: torch.Tensor, c0: int) -> torch.Tensor:
        return torch.empty(len(set(self._chunk(c0))), dtype=torch.long, device=s_seq.device)

    def select(self, t: torch.Tensor, valid: torch.Tensor, c0: int) -> torch.Tensor:
        return torch.empty(self._nvalid(c0), dtype=t.dtype, device=t.device)

    def columns(self, mark: torch.Tensor, c0: int) -> torch.Tensor:
        rows = self._chunk(c0)
        for s in rows:
            self.done[s] += 1
        ncols = min(self.vocab, sum(max(0, self.done[s] - 1) for s in sorted(set(rows))))
        return torch.empty(ncols, dtype=torch.long, device=mark.device)

    def bounded(self, head: "LogitHead", h: torch.Tensor) -> bool:
        h.float().norm(dim=1)  # what `LogitHead.bound` allocates
        return True

    def any(self, valid: torch.Tensor, c0: int) -> bool:
        return self._nvalid(c0) > 0


def chunked_logprobs(
    hidden_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head: LogitHead,
    ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    lengths: torch.Tensor,
    chunk: int,
    values: PenaltyValues | None = None,
) -> torch.Tensor:
    """Mean penalized log-probability of rows P-1 .. n-2 of each sequence ([B], float64 values).

    Numbers as the reference computes them in the logits' dtype (`head.dtype`): the penalized
    logit is formed in float32 and rounded to that dtype (in float16 a logit past 65,504 becomes
    -inf, as the reference's `.to(logit.dtype)` makes it); each row's log-probability is rounded
    to that dtype (the reference's `log_softmax` output); the sum over a sequence accumulates in
    float32 and is rounded to that dtype before the division (the reference's `.sum(-1)`), so it
    overflows to -inf exactly where the reference's does. The log-sum-exp itself runs in float32.
    A NaN or infinite mean is returned as is: the caller maps it to -11.

    `ids` [B, N] padded token ids, `prompt_lens` P [B], `lengths` n [B] (every n > P).
    `hidden_at(seq, pos)` gives the body's last hidden states at those rows; `head(h, out)` writes
    their (scaled) float32 logits over the vocabulary into `out`.

    Per chunk of at most `chunk` rows, one [rows, V] buffer (reused across chunks) is written by
    the head and then walked in place by the log-sum-exp (exp and sum; max and subtract too when
    the logits are not provably bounded, see `LogitHead.bound`); the penalty only
    gathers and scatters the columns of tokens that the chunk's sequences have seen.

    `values`: how the value-dependent sizes are read (default `PenaltyValues`; `PenaltyShapes` is
    the simulation's shape-only mode).
    """
    values = values if values is not None else PenaltyValues()
    device = ids.device
    b = ids.shape[0]
    vocab = head.vocab
    counts = lengths - prompt_lens  # rows per sequence: P-1 .. n-2
    seq = values.rows(counts)
    starts = torch.cumsum(counts, 0) - counts  # first flat row of each sequence
    pos = prompt_lens[seq] - 1 + (torch.arange(seq.numel(), device=device) - starts[seq])
    target = ids[seq, pos + 1]
    # Row i adds source token ids[i-1] to the seen counts once i-1 >= P (so ids[P:i] is counted).
    src = torch.where(pos - 1 >= prompt_lens[seq], ids[seq, (pos - 1).clamp(min=0)], -1)
    # Seen counts of every sequence before the current chunk (dense: B x V int32, small next to
    # one chunk of logits for B <= chunk).
    seen = torch.zeros(b, vocab, dtype=torch.int32, device=device)
    penalty = torch.tensor(PENALTY, dtype=torch.float32, device=device)
    dtype = head.dtype
    narrow = dtype != torch.float32  # round to the logits' dtype where the reference holds values in it
    sums = torch.zeros(b, dtype=torch.float32, device=device)  # the reference's float32 accumulator
    total = seq.numel()
    buf = torch.empty(min(chunk, total), vocab, dtype=torch.float32, device=device)
    for c0 in range(0, total, chunk):  # loop over row chunks, not positions
        c1 = min(total, c0 + chunk)
        r = c1 - c0
        s_seq, s_src = seq[c0:c1], src[c0:c1]
        logits = buf[:r]
        h = hidden_at(s_seq, pos[c0:c1])
        head(h, logits)
        valid = s_src >= 0
        in_chunk = values.sequences(s_seq, c0)  # rows are grouped by sequence
        mark = (seen[in_chunk] > 0).any(0)
        mark[values.select(s_src, valid, c0)] = True
        cols = values.columns(mark, c0)
        # Shift-free log-sum-exp only when |logit| <= SAFE_EXP is proven and some column is left
        # unpenalized in every row (so each row keeps a term >= exp(-SAFE_EXP)).
        bounded = cols.numel() < vocab and values.bounded(head, h)
        if cols.numel():
            onehot = (s_src.unsqueeze(1) == cols.unsqueeze(0)).to(torch.int32)
            csum = torch.cat([onehot.new_zeros(1, cols.numel()), onehot.cumsum(0)])
            # Segmented cumsum: subtract what the chunk counted before each row's sequence began.
            seg0 = (starts[s_seq] - c0).clamp(min=0)
            cnt = csum[1:] - csum[seg0] + seen[s_seq.unsqueeze(1), cols.unsqueeze(0)]
            idx = cols.unsqueeze(0).expand(r, -1)
            x = logits.gather(1, idx)
            f = torch.pow(penalty, cnt.float())
            pen = torch.where(cnt > 0, torch.where(x < 0, x * f, x / f), x)
            if narrow:  # float16: |x| * 1.2^c past 65,504 saturates to -inf, as in the reference
                pen = pen.to(dtype).float()
            logits.scatter_(1, idx, pen)
            if values.any(valid, c0):
                v_src = values.select(s_src, valid, c0)
                seen.index_put_((values.select(s_seq, valid, c0), v_src), torch.ones_like(v_src, dtype=torch.int32),
                                accumulate=True)
        tgt = logits.gather(1, target[c0:c1].unsqueeze(1)).squeeze(1)
        lse = lse_inplace(logits, bounded)  # in place: the buffer is not needed after this chunk
        lp = tgt - lse
        if narrow:
            lp = lp.to(dtype).float()
        sums.index_add_(0, s_seq, lp)
    # The reference's `sum(-1) / loss_mask.sum(-1)`: the sum in the logits' dtype (float16
    # overflows past 65,504), divided in that dtype.
    return (sums.to(dtype).float() / counts.float()).to(dtype).double()


class DpoScorer(Scorer):
    """The DPO reference-model log-probability reward."""

    name = DPO.name
    kind = "reward"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg, self.runtime = cfg, runtime
        source, how = load_source(cfg, str(cfg.path))  # locked commit, remote code only if allowed
        self.tokenizer, self.model = runtime.models.pretrained(source, AutoModelForCausalLM, dtype=cfg.dtype, **how)
        self.body = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.scale = logits_scale(self.model)
        self.max_len = sane_max_length(self.tokenizer, self.model.config, cfg.max_length)
        # logits_chunk bounds the [rows, V] buffer (memory); within it the fastest row count is
        # measured at load (on CPU a cache-sized chunk is ~4x faster than 512 rows).
        self.max_chunk = max(1, int(cfg.options.get("logits_chunk", 512)))
        self.vocab = int(self.lm_head.weight.shape[0])
        self.logit_head = LogitHead(self.lm_head, self.scale)
        tune = bool(cfg.options.get("tune_logits_chunk", True))
        self.chunk_timings: dict[int, float] = {}
        # `tune` runs with the calibration (on the device the model runs on), or the calibration
        # cache gives the chunk it found before; a tight budget may lower `chunk` per call.
        self.chunk = self.tuned_chunk = self.max_chunk
        # The shared prefix needs cache objects: a legacy-cache model runs full sequences.
        self.use_prefix = choose_path(self.name, self.body, self.vocab, wanted=bool(cfg.options.get("shared_prefix", True)))
        self.max_batch = cfg.batch_size or int(cfg.options.get("max_batch", 16))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.calib_len = min(self.max_len, int(cfg.options.get("calibration_length", self.max_len)))  # the planner admits no more
        self.chunk_costs: dict[int, CostModel] = {}  # logits chunk -> cost model measured at that chunk
        runtime.memory.calibrate(self.name, self._dummy, max_length=self.calib_len, max_batch=16, chunk=self.chunk, chunk_rows=True,
                                 tune=(lambda: {"chunk": self._tune_chunk()}) if tune else None, apply=self._use_chunk)

    def _use_chunk(self, settings: dict) -> None:
        """The tuned logits chunk, measured now or read from the calibration cache."""
        self.chunk = self.tuned_chunk = int(settings.get("chunk", self.max_chunk))

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        return logits * self.scale if self.scale != 1.0 else logits

    def _tune_chunk(self) -> int:
        """The fastest logits chunk (rows) up to `max_chunk`, measured on this machine at load.

        Each candidate (powers of two from 16, and `max_chunk`) runs `chunked_logprobs` itself
        (head, penalty bookkeeping, log-sum-exp) on a synthetic batch: 4 sequences of random ids,
        random hidden rows in place of the body's, 2 x `max_chunk` scored rows in all; the best of
        two runs counts. The choice changes speed only: every chunk size gives the same numbers
        up to float32 rounding, and memory stays bounded by the cap.
        """
        cands = sorted({c for c in (16, 32, 64, 128, 256, 512, 1024, 2048) if c < self.max_chunk} | {self.max_chunk})
        if len(cands) == 1:
            return cands[0]
        device = model_device(self.model)
        w = self.lm_head.weight
        g = torch.Generator().manual_seed(0)
        b, n = 4, max(2 * cands[-1], 512) // 4 + 1
        ids = torch.randint(0, self.vocab, (b, n), generator=g).to(device)
        hidden = torch.randn(b, n, w.shape[1], generator=g).to(device=device, dtype=w.dtype)
        plens = torch.ones(b, dtype=torch.long, device=device)
        lengths = torch.full((b,), n, dtype=torch.long, device=device)
        hidden_at = lambda s, p: hidden[s, p]  # noqa: E731
        with torch.inference_mode():
            for c in cands:
                best = math.inf
                for _ in range(2):
                    if device.type == "cuda":  # pragma: no cover - GPU only
                        torch.cuda.synchronize(device)
                    t = time.perf_counter()
                    chunked_logprobs(hidden_at, self.logit_head, ids, plens, lengths, c)
                    if device.type == "cuda":  # pragma: no cover
                        torch.cuda.synchronize(device)
                    best = min(best, time.perf_counter() - t)
                self.chunk_timings[c] = best
        return min(cands, key=lambda c: self.chunk_timings[c])

    def _fit_chunk(self, longest: int) -> int:
        """Shrink the logits chunk, not the input, while the budget cannot hold `longest` tokens.

        The chunk only trades speed for memory (every chunk gives the same numbers), so under a
        tight budget it halves first, down to 16 rows; only then are inputs cut. Returns the
        length cap that remains. A chunk is only used with a cost model measured at that chunk:
        the fit at the tuned chunk, extrapolated, predicted too little at 5,000+ tokens (its
        planned batches ran out of memory), so each smaller chunk is profiled the first time it
        would be chosen (and cached with the calibration). The extrapolation still decides which
        chunks to skip: when it says a chunk cannot hold the input, the next one is tried.
        """
        memory = self.runtime.memory
        if memory.budget_bytes is None:  # nothing to fit: the tuned chunk, inputs cut at max_len only
            self.chunk = self.tuned_chunk
            return self.max_len
        self._use_chunk_cost(self.tuned_chunk)
        cap = min(self.max_len, memory.length_cap(self.name, self.max_len))
        chunk = self.tuned_chunk
        while cap < longest and chunk > 16:
            chunk //= 2
            # The tuned fit with this chunk's terms: a cheap first guess.
            memory.cost_models[self.name] = CostModel.from_dict({**self.chunk_costs[self.tuned_chunk].to_dict(), "chunk": chunk})
            rough = min(self.max_len, memory.length_cap(self.name, self.max_len))
            if rough < longest and chunk > 16:
                continue  # even the guess says no: try the next chunk without profiling this one
            self._use_chunk_cost(chunk)
            cap = min(self.max_len, memory.length_cap(self.name, self.max_len))
        self._use_chunk_cost(chunk)
        return cap

    def _use_chunk_cost(self, chunk: int) -> None:
        """Run with `chunk` rows and the cost model measured at it (profiling it the first time)."""
        memory = self.runtime.memory
        if self.tuned_chunk not in self.chunk_costs:  # the calibration's fit, however it was made
            self.chunk_costs[self.tuned_chunk] = memory.cost_model(self.name)
        if chunk not in self.chunk_costs:
            self.chunk = chunk
            log.info("%s: profiling the %d-row logits chunk the budget needs", self.name, chunk)
            self.chunk_costs[chunk] = memory.calibrate(
                f"{self.name}[chunk={chunk}]", self._dummy, max_length=self.calib_len, max_batch=16,
                chunk=chunk, chunk_rows=True)
        self.chunk = chunk
        memory.cost_models[self.name] = self.chunk_costs[chunk]

    def _dummy(self, b: int, length: int) -> None:
        """A profile pass: B random sequences of `length` tokens, all but the first row scored."""
        ids = dummy_ids(self.vocab, b, length)  # random ids: the penalty sees the most columns
        self._forward(profile_runner(self.body, ids, enabled=self.use_prefix, pad_id=self.pad_id), ids, [1] * b)

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
            hidden_at, self.logit_head, padded.to(device), torch.tensor(list(plens), device=device), n,
            self.chunk,
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
        cap = self._fit_chunk(min(self.max_len, max(len(x) for x in enc)))
        ids: list[list[int]] = []
        keep: list[int] = []
        for i, x in zip(todo, enc):
            if len(x) > self.max_len:
                res.statuses[i] = Status.TRUNCATED
            if len(x) > cap:  # the budget cannot hold it whole: cut further (not the spec's number)
                res.statuses[i] = Status.TRUNCATED
            if cap <= p < len(x):
                # The budget cannot hold one completion token after the prompt: not scored (a -11
                # here would be our budget's number, not the spec's, and would enter the statistics).
                res.statuses[i] = Status.OOM
                continue
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

        lengths = [len(x) for x in ids]

        def forward(batch: list[int]) -> list[float]:
            return run_in_groups(batch, lengths, lambda sel: self._forward(runner, [ids[j] for j in sel], [p] * len(sel)))

        outcomes = self.runtime.memory.run(self.name, lengths, forward, max_batch=self.max_batch, prepare=runner.state)
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


def make_standin(folder: Path, *, max_length: int = 8192, config_overrides: dict | None = None) -> dict:
    """A tiny random GPT-2-style LM (BTLM is GPT-2 based) with the real BERT tokenizer, 8k context.

    `config_overrides` replaces GPT2Config fields (e.g. n_embd, n_layer, n_head for a stand-in
    whose body outweighs its head, as BTLM's does); the default is the tiny CI model.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_standin_tokenizer(folder, max_length)
    fields: dict = dict(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
    )
    fields.update(config_overrides or {})
    config = GPT2Config(**fields)
    torch.manual_seed(1234)
    GPT2LMHeadModel(config).save_pretrained(str(folder), safe_serialization=True)
    return {"path": folder.name, "dtype": "float32"}
