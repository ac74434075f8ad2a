"""The same input, the same score: a reward model's start-up check, and the row counts of fixed-shape passes.

A row's score must not depend on what shares its pass. Padding each row to a width of its own
(`hfreward.pad_width`) fixes the token dimension, but the number of rows in a pass is part of every
matrix product's shape, and the BLAS (MKL on x86, cuBLAS on a GPU) picks its kernel, and so its
order of summation, by shape. MKL's strict mode (`rewardstack._reproducible`) fixes that on the
CPUs where it holds; where it does not (other CPUs, other BLAS libraries, a GPU) passes of a fixed
number of rows per width, filler rows added when fewer wait, give every row the same shapes whatever
its company.

`differing` is the check: probe texts scored alone and spread over full passes, with companions
shorter than them (the masked path) and, at the cap width, with companions that fill it too (an
all-ones mask, which sdpa drops for another kernel); the widths whose bits differ are returned. `choose_rows` measures each width's rows per pass: the fewest rows whose throughput is
within `ROWS_TOLERANCE` of the most a pass may hold (a filler row costs as much as a real one, so
fewer rows waste less when few requests wait), widths in ascending order until one row is chosen
(the per-pass costs are a smaller share of a wider pass).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

CANDIDATE_ROWS = (1, 4, 8)
"""Rows per pass a width may be given. Not 2: MKL's product with one output column (the score head)
rounds the second of two rows otherwise than the first (AMD EPYC, strict mode or not), as it does the
last of 3 or 5; 4, 8 and 16 rows kept every position's bits."""
ROWS_TOLERANCE = 0.10
"""How much slower per row than the widest candidate a narrower pass may be and still be chosen."""
PROBES = 3
"""Probe texts the check scores at each width."""
POSITIONS = 8
"""A pass of up to this many rows has the probes checked at every position; a wider one twice."""
PROBE = "The same input, the same reward: a probe scored alone and in a full pass at start-up. "

Score = Callable[[list[list[int]]], list[Any]]
"""Scores rows of ids as the scorer's passes run them: one value per row, in order."""


@dataclass
class Invariance:
    """What a reward model's start-up check found and what its passes do (the log, `/v1/models`, `/health`)."""

    setting: str
    """The model's `fixed_shapes` option: "auto", "on" or "off"."""
    strict_blas: str
    """MKL's strict mode in this process: "on", "off", or "unavailable" (no MKL; a GPU's passes)."""
    fixed_shapes: bool = False
    """Whether every pass has a fixed number of rows per width (filler rows added)."""
    same_bits: bool = True
    """Whether the probe kept its alone bits in full passes with the shapes the model runs now."""
    found: str = ""
    """What the check saw, in words."""
    rows: dict[int, int] = field(default_factory=dict)
    """Width -> rows of every pass (fixed shapes on)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (widths as strings)."""
        return asdict(self) | {"rows": {str(w): n for w, n in sorted(self.rows.items())}}


def probe(tokenizer: Any, length: int, shift: int = 0) -> list[int]:
    """`length` ids of the probe text, its words rotated by `shift` (companions: other texts)."""
    words = PROBE.split()
    k = shift % len(words)
    text = " ".join(words[k:] + words[:k]) + " "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (list(ids) * (length // max(1, len(ids)) + 1))[:length]


def differing(score: Score, tokenizer: Any, widths: Sequence[int], cap: int, size: Callable[[int], int]) -> list[int]:
    """The widths at which a probe's score differs, bit for bit, between alone and in a full pass
    (`size(width)` rows), with shorter companions and, at `cap`, with companions that fill it too.

    `PROBES` probes share each full pass, spread over it; a pass of up to `POSITIONS` rows is run
    with every probe at every position, a wider one twice. Several probes, because a kernel with
    another order of summation rounds most rows differently, not every one (a probe kept its bits at
    the second of two rows where other texts did not)."""
    out = []
    for w in widths:
        n = size(w)
        if n == 1:
            continue  # one row a pass: the same tensor whatever the company
        longest = w if w == cap else w - 1  # below the cap a row always has a pad position (`pad_width`)
        shortest = max(1, longest - max(1, w // 8))
        k = min(PROBES, n)
        mine = [probe(tokenizer, longest, -j) for j in range(k)]
        alone = [score([p])[0] for p in mine]
        others = [[probe(tokenizer, shortest, j + 1) for j in range(n)]]
        if w == cap:
            others.append([probe(tokenizer, cap, j + 1) for j in range(n)])
        for rows, shift in ((r, s) for r in others for s in (range(n) if n <= POSITIONS else (1, n - 1))):
            spots = [(shift + j * (n // k)) % n for j in range(k)]
            full = list(rows)
            for j, at in enumerate(spots):
                full[at] = mine[j]
            got = score(full)
            if any(not _same(got[at], alone[j]) for j, at in enumerate(spots)):
                out.append(w)
                break
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))


def choose_rows(run: Callable[[int, int], Any], widths: Sequence[int], most: Callable[[int], int], *,
                rounds: int = 3) -> dict[int, int]:
    """Rows of every pass per width, measured: `run(rows, width)` is one pass; `most(width)` the rows
    a pass may hold there (the pass-token cap, the memory plan).

    A pass's time is fitted as fixed + rows x per-row from one row and the most candidate rows
    (fastest of `rounds` interleaved), and the fewest rows within `ROWS_TOLERANCE` of the most's
    time per row are chosen."""
    rows: dict[int, int] = {}
    chosen = 0
    for w in sorted(widths):
        top = max((n for n in CANDIDATE_ROWS if n <= most(w)), default=1)
        if chosen == 1 or top == 1:
            rows[w] = chosen = 1
            continue
        if not rows:
            run(1, w)  # first-call costs out of the timing
        one = many = math.inf
        for _ in range(rounds):
            one = min(one, _timed(run, 1, w))
            many = min(many, _timed(run, top, w))
        per_row = max(1e-9, (many - one) / (top - 1))
        fixed = max(0.0, one - per_row)
        best = fixed / top + per_row
        chosen = min(n for n in CANDIDATE_ROWS if n <= top and fixed / n + per_row <= best * (1 + ROWS_TOLERANCE))
        rows[w] = chosen
    return rows


def _timed(run: Callable[[int, int], Any], n: int, width: int) -> float:
    t = time.perf_counter()
    run(n, width)
    return time.perf_counter() - t
