"""DPO's numerics: the logits head into a reused buffer, the penalty, the log-sum-exp, the mean.

`chunked_logprobs` is the one implementation of the spec's DPO number (docs/SEMANTICS.md, "DPO")
over chunks of scored rows: the repetition penalty touches only the columns of tokens already
seen, the log-sum-exp runs in place in float32, and values are rounded to the logits' dtype where
the reference holds them in it. `LogitHead` writes the head's (scaled) float32 logits; `LOW` is the
spec's worst score and `PENALTY` the repetition penalty. The scorer (`dpo.py`) and the memory
simulation call these; nothing here knows of models' bodies, budgets or requests.
"""

from __future__ import annotations

from typing import Callable

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


def chunked_logprobs(
    hidden_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head: LogitHead,
    ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    lengths: torch.Tensor,
    chunk: int,
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
    """
    device = ids.device
    b = ids.shape[0]
    vocab = head.vocab
    counts = lengths - prompt_lens  # rows per sequence: P-1 .. n-2
    seq = torch.repeat_interleave(torch.arange(b, device=device), counts)
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
        in_chunk = torch.unique_consecutive(s_seq)  # rows are grouped by sequence
        mark = (seen[in_chunk] > 0).any(0)
        mark[s_src[valid]] = True
        cols = mark.nonzero().squeeze(1)
        # Shift-free log-sum-exp only when |logit| <= SAFE_EXP is proven and some column is left
        # unpenalized in every row (so each row keeps a term >= exp(-SAFE_EXP)).
        bounded = cols.numel() < vocab and head.bound(h) <= SAFE_EXP
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
            if valid.any():
                seen.index_put_((s_seq[valid], s_src[valid]), torch.ones_like(s_src[valid], dtype=torch.int32),
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
