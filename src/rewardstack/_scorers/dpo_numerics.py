"""DPO's numerics: the logits head into a reused buffer, the penalty, the log-sum-exp, the mean.

`chunked_logprobs` is the one implementation of the spec's DPO number (docs/SEMANTICS.md, "DPO")
over chunks of scored rows: the repetition penalty touches only the columns of tokens already
seen, the log-sum-exp runs in place in float32, and values are rounded to the logits' dtype where
the reference holds them in it. `LogitHead` writes the head's (scaled) float32 logits; `LOW` is the
spec's worst score and `PENALTY` the repetition penalty. `PenaltyValues` reads the sizes that
depend on token values; `PenaltyShapes` is its shape-only mode, for the meta-device simulation
(`rewardstack._planning`). The scorer (`dpo.py`) and the memory
simulation call these; nothing here knows of models' bodies, budgets or requests.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LOW = -11.0  # exp(-11) is below 1/vocab: the spec's "worst" score
PENALTY = 1.2  # the CTRL paper's repetition penalty, as in the reference


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
        self._wmax = float(self.weight.detach().float().norm(dim=1).max())  # the float32 copy is freed at once
        self._bmax = float(self.bias.detach().float().abs().max()) if self.bias is not None else 0.0

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
    (`rewardstack._planning.simulate`) runs `chunked_logprobs` on meta tensors, which hold no
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


def _penalize(logits: torch.Tensor, cols: torch.Tensor, s_seq: torch.Tensor, s_src: torch.Tensor, seen: torch.Tensor,
              seq_start: torch.Tensor, penalty: torch.Tensor, narrow: torch.dtype | None) -> None:
    """The repetition penalty on one chunk's logits, in place, at the columns `cols` only.

    A row's count of a token is what its sequence saw before the chunk (`seen`) plus what the chunk
    saw before that row within the same sequence (`seq_start`: where the row's sequence begins,
    relative to the chunk). `narrow`: the logits' dtype when it is not float32 (the penalized logit
    is rounded to it: in float16 |x| * 1.2^c past 65,504 saturates to -inf, as in the reference).
    """
    r = logits.shape[0]
    onehot = (s_src.unsqueeze(1) == cols.unsqueeze(0)).to(torch.int32)
    csum = torch.cat([onehot.new_zeros(1, cols.numel()), onehot.cumsum(0)])
    # Segmented cumsum: subtract what the chunk counted before each row's sequence began.
    cnt = csum[1:] - csum[seq_start.clamp(min=0)] + seen[s_seq.unsqueeze(1), cols.unsqueeze(0)]
    idx = cols.unsqueeze(0).expand(r, -1)
    x = logits.gather(1, idx)
    f = torch.pow(penalty, cnt.float())
    pen = torch.where(cnt > 0, torch.where(x < 0, x * f, x / f), x)
    if narrow is not None:
        pen = pen.to(narrow).float()
    logits.scatter_(1, idx, pen)


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

    `values`: how value-dependent sizes are read (`PenaltyShapes`: the simulation's shape-only mode).
    """
    values = values if values is not None else PenaltyValues()
    device, b, vocab = ids.device, ids.shape[0], head.vocab
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
            _penalize(logits, cols, s_seq, s_src, seen, starts[s_seq] - c0, penalty, dtype if narrow else None)
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
