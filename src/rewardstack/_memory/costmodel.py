"""Predicts the peak activation bytes of one forward pass from its padded shape, and plans batches by it.

bytes(B, L) = a + b*B*L + c*B*L^2 + d*B + e*L + f*L^2.

`b` carries the per-token tensors (hidden states, logit chunks), `c` the attention scores that grow
with the square of the length (DeBERTa's disentangled attention). The three extra terms are the
ones measured on real architectures that the first three cannot express: `d` per-sequence tensors
whose size does not depend on the length (DeBERTa's relative-position embeddings projected per
batch row), `e` and `f` batch-independent tensors (position ids, DeBERTa's L x L relative-position
bucket matrix). They default to 0. A scorer that computes logits in chunks of `chunk` positions (the causal-LM scorers) sets `chunk`, adding a
term g*B*min(L, chunk): the logit chunk grows with L up to the chunk size and then stays flat.
A scorer whose chunks run over the rows of the whole batch (DPO) sets `chunk_rows`, and the term
becomes g*min(B*L, chunk).

A pass whose peak is the larger of two phases is fitted as the maximum of two such sums (`alt`):
DPO's peak is either in its body (activations growing with B*L) or in the logits phase after it
(the flat [chunk, V] buffer, the per-row seen-count table, the penalty's bookkeeping); one sum
would charge the logits phase on top of the body's growth.

The coefficients are fitted by exact non-negative least squares on relative error to peaks measured
in a short profile run (`profile`); `trust` (<= 1) shrinks the budget a model may plan against
after its predictions were proved wrong by an OOM, and grows back after a run of clean batches
(`record_clean`), so a few OOMs do not keep batches small forever.

A pass that runs after a shared prefix (the causal scorers' `PrefixRunner`: the step's common
prompt runs once, its keys and values live before the batches are planned) costs less than a
pass over the whole length: only the suffix's tokens make hidden states, MLP temporaries and
logit rows, while the prefix adds each row's copy of its keys and values (`prefix_rate` bytes per
row per prefix token) and the suffix's queries scored against the prefix's keys (`prefix_cross`
per row per prefix token per suffix token). The profile runs with a one-token prefix (the largest
case for a length), so `predict(B, L)` is that upper bound; with the two rates measured
(`fit_prefix`), `predict(B, L, prefix=P)` is
min(bytes(B, L), bytes(B, S) + B*(L - S)*(prefix_rate + prefix_cross*S)), S = L - P but never
below the shortest profiled length: never above the bound, never below what the prefixed profile
passes measured, and never a fit extrapolated below the lengths it measured. A rate alone would
not do: the prefixed profile passes are long, and a rate taken from them charges their long
suffix's attention against the prefix to every short pass after a short prompt.

A lone input is never padded, so an encoder runs it without an attention mask (sdpa drops an
all-ones mask), while the profile's batches carry one padded position so that the mask is built as
in real batches. With a `lone` model (fitted to unpadded single-input passes, `profile(lone_run=)`)
`predict(1, L)` is that pass's, without the padded batches' [B, 1, L, L] mask.

The profile (`profile`) measures a grid of shapes (`profile_shapes`), the prefixed passes
(`prefix_profile_shapes`) and the lone inputs, and fits the model. A fit is only trusted where it
was measured: `admits(B, L)` is false for a batch longer, wider or with more tokens than the
largest profiled shape (as vLLM sizes its cache from a profile run at the maximum batched shape),
and the planner never builds such a batch.

The planner (`plan_batches`) is token-budget batching: as in TEI, a batch costs batch_size x
longest_length (padding is paid for), so inputs are sorted by length first. A batch is closed when
adding the next input would push the predicted peak past the budget (times a safety margin and the
model's trust), or would make a shape the cost model never measured (`admits`). Predictions are
only used inside the profiled range, never extrapolated. With `slack`, a batch is also closed when
its padded rectangle would waste more than that share of it on padding (`padding_groups`' rule): a
scorer that runs each batch in such padding groups then runs exactly the batch that was planned
and predicted, not a smaller rectangle inside it (charging the whole rectangle would over-predict
the calls several times over).
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

log = logging.getLogger("rewardstack.memory")

TERMS = ("a", "b", "c", "d", "e", "f", "g", "h")
_TERM_NAMES = ("1", "B*L", "B*L^2", "B", "L", "L^2", "chunk", "penalty")  # `describe`
TWO_PIECE_MIN_SAMPLES = 8  # fewer samples cannot support two pieces of up to eight terms
TWO_PIECE_ABOVE = 0.05  # a single sum fitting within 5% everywhere is kept as it is


def _features(batch: float, length: float, chunk: int | None = None, chunk_rows: bool = False) -> list[float]:
    """The terms of the model, in the order of `TERMS`."""
    bl = batch * length
    chunked = 0.0
    if chunk:
        chunked = min(bl, chunk) if chunk_rows else batch * min(length, chunk)
    # DPO's penalty temporaries: each chunk row against the columns its sequence has seen, past
    # the first chunk (below it the rows x columns square is c's B*L^2, with the attention mask).
    penalty = float(chunked) * max(0.0, length - chunk) if (chunk and chunk_rows) else 0.0
    return [1.0, bl, bl * length, float(batch), float(length), float(length) * length, float(chunked), penalty]


@dataclass
class CostModel:
    """Peak activation bytes as a function of (batch, padded length)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    trust: float = 1.0
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (B, L, measured bytes)
    d: float = 0.0
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0
    h: float = 0.0  # chunk_rows only: h*min(B*L, chunk)*max(0, L-chunk), the penalty's rows x columns
    chunk: int | None = None
    chunk_rows: bool = False  # the chunk spans the batch's rows: g*min(B*L, chunk)
    clean: int = 0  # batches run without an OOM since trust was last lowered
    prefix_rate: float | None = None  # bytes per row per shared-prefix token; None: not measured
    prefix_cross: float = 0.0  # bytes per row per prefix token per suffix token
    prefix_samples: list[tuple[int, int, int, int]] = field(default_factory=list)  # (B, L, prefix, bytes)
    lone: "CostModel | None" = None  # batches of one, measured unpadded; None: the padded fit's
    alt: list[float] | None = None  # a second piece (coefficients in the order of TERMS): bytes = max(both)

    def extents(self) -> tuple[int, int, int] | None:
        """(largest batch, longest length, most tokens B*L) profiled; None when nothing was measured."""
        if not self.samples:
            return None
        return (max(b for b, _, _ in self.samples), max(l for _, l, _ in self.samples),
                max(b * l for b, l, _ in self.samples))

    def admits(self, batch: int, length: int) -> bool:
        """Whether (batch, length) lies inside the profiled shapes (always, for a model never profiled)."""
        ext = self.extents()
        return ext is None or (batch <= ext[0] and length <= ext[1] and batch * length <= ext[2])

    def coefficients(self) -> list[float]:
        """The coefficients in the order of `TERMS`."""
        return [self.a, self.b, self.c, self.d, self.e, self.f, self.g, self.h]

    def predict(self, batch: int, length: int, prefix: int = 0) -> float:
        """Predicted peak bytes of one forward pass over a (batch, length) padded rectangle.

        `prefix`: that many of the `length` tokens are a shared prefix run before the pass (see the
        module docstring); without a measured `prefix_rate` it changes nothing.
        """
        if batch <= 0 or length <= 0:
            return 0.0
        if batch == 1 and self.lone is not None and prefix <= 0:
            return self.lone._bytes(1, length)
        full = self._bytes(batch, length)
        if prefix <= 0 or self.prefix_rate is None or length <= 1:
            return full
        # The suffix is never taken shorter than the shortest profiled length: below it the fit
        # was never measured (a long prompt and a five-token completion would extrapolate).
        floor = min((l for _, l, _ in self.samples), default=1)
        suffix = max(length - int(prefix), floor, 1)
        if suffix >= length:
            return full
        per_token = self.prefix_rate + self.prefix_cross * suffix
        return min(full, self._bytes(batch, suffix) + per_token * batch * (length - suffix))

    def _bytes(self, batch: float, length: float) -> float:
        x = _features(batch, length, self.chunk, self.chunk_rows)
        first = float(sum(k * v for k, v in zip(self.coefficients(), x)))
        if self.alt is None:
            return first
        return max(first, float(sum(k * v for k, v in zip(self.alt, x))))

    def fit_prefix(self, samples: Sequence[tuple[int, int, int, int]]) -> "CostModel":
        """Set `prefix_rate` and `prefix_cross` from passes measured after a long shared prefix:
        (B, L, prefix, bytes).

        Each pass's excess over the fit at its suffix length S is fitted as B*P*(rate + cross*S) by
        non-negative least squares on bytes (the large passes are the ones that must be right),
        then both scaled up until every measured pass is covered: a prediction is never below one.
        """
        self.prefix_samples = [tuple(int(v) for v in s) for s in samples]  # type: ignore[misc]
        rows = [(b * p, b * p * (l - p), max(0.0, m - self._bytes(b, l - p)))
                for b, l, p, m in samples if b > 0 and 0 < p < l]
        if not rows:
            self.prefix_rate, self.prefix_cross = None, 0.0
            return self
        x = np.array([r[:2] for r in rows], dtype=np.float64)
        y = np.array([r[2] for r in rows], dtype=np.float64)
        coef = _nnls(x, y, relative=False)
        pred = x @ coef
        cover = max([1.0] + [float(e / q) for e, q in zip(y, pred) if q > 0])
        self.prefix_rate, self.prefix_cross = (float(v * cover) for v in coef)
        return self

    def fit(self, samples: Sequence[tuple[int, int, int]]) -> "CostModel":
        """Non-negative least-squares fit of the coefficients to measured (B, L, bytes) samples.

        With fewer distinct batches or lengths than a term needs, that term is left out rather than
        guessed (e.g. one batch size cannot separate `d*B` from `a`).

        Where one sum of terms fits badly (worst relative error over `TWO_PIECE_ABOVE`), the fit
        tries the maximum of two sums (`alt`, see `_fit_two_pieces`) and keeps it when it halves
        the squared error: a pass whose peak is the larger of two phases (DPO: the body's
        activations, or the logits chunk with the penalty's bookkeeping after it) is a max.
        """
        if not samples:
            raise ValueError("cannot fit a cost model to no samples")
        self.samples = [tuple(int(v) for v in s) for s in samples]  # type: ignore[misc]
        coef = _fit_terms(self.samples, self.chunk, self.chunk_rows)
        self.alt = None
        errors = _relative_errors(self.samples, [coef], self.chunk, self.chunk_rows)
        if len(self.samples) >= TWO_PIECE_MIN_SAMPLES and float(np.abs(errors).max()) > TWO_PIECE_ABOVE:
            two = _fit_two_pieces(self.samples, self.chunk, self.chunk_rows)
            if two is not None and two[2] < 0.5 * float(np.sum(errors**2)):
                coef, self.alt = two[0], [float(v) for v in two[1]]
        self.a, self.b, self.c, self.d, self.e, self.f, self.g, self.h = (float(v) for v in coef)
        return self

    def max_error(self) -> float:
        """The largest relative error of the fit over the samples it saw."""
        return max((abs(self.predict(b, l) - m) / max(m, 1) for b, l, m in self.samples), default=0.0)

    def distrust(self, factor: float = 0.8, floor: float = 0.25) -> None:
        """Lower trust after an OOM: later plans use a smaller share of the budget."""
        self.trust = max(floor, self.trust * factor)
        self.clean = 0

    def record_clean(self, run: int = 20, factor: float = 0.8) -> bool:
        """Count one batch that ran without an OOM; after `run` in a row, undo one `distrust` step.

        Returns whether trust grew. An OOM (`distrust`) restarts the count.
        """
        if self.trust >= 1.0:
            self.clean = 0
            return False
        self.clean += 1
        if self.clean < run:
            return False
        self.trust = min(1.0, self.trust / factor)
        self.clean = 0
        log.info("cost model trusted again after %d clean batches: trust %.2f", run, self.trust)
        return True

    def describe(self) -> str:
        """One line for logs."""
        def terms(coef: Sequence[float]) -> str:
            return " + ".join(f"{v:.3g}*{t}" for v, t in zip(coef, _TERM_NAMES) if v) or "0"

        alt = f" or, where larger, {terms(self.alt)}" if self.alt is not None else ""
        prefixed = (f"; {self.prefix_rate:.3g} + {self.prefix_cross:.3g}*suffix bytes per row per shared-prefix token"
                    if self.prefix_rate is not None else "")
        lone = f"; alone (unpadded): {terms(self.lone.coefficients())}" if self.lone is not None else ""
        return (f"bytes = {terms(self.coefficients())}{alt} (chunk {self.chunk}, trust {self.trust:.2f}, "
                f"{len(self.samples)} shapes, max fit error {self.max_error():.1%}{prefixed}{lone})")

    def to_dict(self, samples: bool = True) -> dict:
        """JSON-able form (the calibration cache, logs and telemetry); `samples=False` leaves out
        the measured shapes the fit came from (what `plan` and the telemetry's records show)."""
        d = asdict(self)
        return d if samples else {k: v for k, v in d.items() if k != "samples"}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of `to_dict`; trust starts at 1."""
        d = {**d, "trust": 1.0, "clean": 0, "lone": cls.from_dict(d["lone"]) if d.get("lone") else None}
        d["samples"] = [tuple(int(v) for v in s) for s in d.get("samples", [])]
        d["prefix_samples"] = [tuple(int(v) for v in s) for s in d.get("prefix_samples", [])]
        return cls(**d)


def _identifiable_terms(
    samples: Sequence[tuple[int, int, int]], chunk: int | None = None, chunk_rows: bool = False
) -> list[int]:
    """Indices of the terms the samples can tell apart."""
    batches = {b for b, _, _ in samples}
    lengths = {l for _, l, _ in samples}
    terms = [0]  # a
    if len(lengths) >= 2 or len(batches) >= 2:
        terms.append(1)  # b*B*L
    if len(lengths) >= 3:
        terms.append(2)  # c*B*L^2
    if len(batches) >= 2 and len(lengths) >= 2:
        terms += [3, 4]  # d*B and e*L: separable from B*L only with two lengths (d) and two batches (e)
    if len(batches) >= 2 and len(lengths) >= 3:
        terms.append(5)  # f*L^2
    sizes = {b * l for b, l, _ in samples} if chunk_rows else lengths
    if chunk and any(v < chunk for v in sizes) and any(v > chunk for v in sizes):
        terms.append(6)  # the chunk term: needs sizes on both sides of the chunk
        if chunk_rows and len(lengths) >= 2:
            terms.append(7)  # the penalty's rows x columns
    return terms


def _design(samples: Sequence[tuple[int, int, int]], chunk: int | None, chunk_rows: bool) -> tuple[np.ndarray, np.ndarray]:
    """The fit's terms per sample (rows in the order of `TERMS`) and the measured bytes."""
    x = np.array([_features(b, l, chunk, chunk_rows) for b, l, _ in samples], dtype=np.float64)
    y = np.array([m for _, _, m in samples], dtype=np.float64)
    return x, y


def _fit_terms(samples: Sequence[tuple[int, int, int]], chunk: int | None, chunk_rows: bool) -> np.ndarray:
    """One sum of terms fitted to `samples` (the terms they identify; the others 0)."""
    x, y = _design(samples, chunk, chunk_rows)
    coef = np.zeros(len(TERMS))
    usable = _identifiable_terms(samples, chunk, chunk_rows)
    coef[usable] = _nnls(x[:, usable], y)
    return coef


def _relative_errors(samples: Sequence[tuple[int, int, int]], pieces: Sequence[np.ndarray], chunk: int | None,
                     chunk_rows: bool) -> np.ndarray:
    """(max(pieces) - measured) / measured for each of `samples`."""
    x, y = _design(samples, chunk, chunk_rows)
    pred = np.max(np.stack([x @ p for p in pieces], 1), 1)
    return (pred - y) / np.maximum(y, 1.0)


def _fit_two_pieces(samples: Sequence[tuple[int, int, int]], chunk: int | None,
                    chunk_rows: bool) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The maximum of two sums of terms fitted to `samples`: (first, second, squared error), or None.

    Max-affine fitting by alternating assignment (Magnani and Boyd's heuristic): each piece is
    fitted to the samples it is assigned, each sample is reassigned to the piece that predicts
    more for it (the max is what a prediction takes), until nothing moves. Started from every
    split of the grid at a token count and at a length (deterministic, a few dozen tiny fits);
    the best final split wins.
    """
    x, _ = _design(samples, chunk, chunk_rows)
    n = len(samples)
    starts = []
    for key in (lambda s: s[0] * s[1], lambda s: s[1]):
        for t in sorted({key(s) for s in samples})[:-1]:
            starts.append(np.array([0 if key(s) <= t else 1 for s in samples]))
    best: tuple[np.ndarray, np.ndarray, float] | None = None
    for assign in starts:
        pieces: list[np.ndarray] = []
        for _ in range(20):
            groups = [[samples[i] for i in range(n) if assign[i] == k] for k in (0, 1)]
            if min(len(g) for g in groups) < 2:
                pieces = []
                break
            pieces = [_fit_terms(g, chunk, chunk_rows) for g in groups]
            new = np.stack([x @ p for p in pieces], 1).argmax(1)
            if (new == assign).all():
                break
            assign = new
        if not pieces:
            continue
        err = float(np.sum(_relative_errors(samples, pieces, chunk, chunk_rows) ** 2))
        if best is None or err < best[2]:
            best = (pieces[0], pieces[1], err)
    return best


def _nnls(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Exact non-negative least squares (on relative error, or on bytes), by trying every subset of terms.

    Seven terms make 127 subsets of tiny solves: cheaper than pulling in scipy, and exact (the
    optimum is the unconstrained solution on some subset that comes out non-negative).
    """
    # Relative: each sample's error counts relative to its size, so small shapes fit as well as big ones.
    w = 1.0 / np.maximum(y, 1.0) if relative else np.ones_like(y)
    xw, yw = x * w[:, None], y * w
    n = x.shape[1]
    best, best_err = np.zeros(n), float("inf")
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(n)
            coef[cols] = sol
            err = float(np.sum((xw @ coef - yw) ** 2))
            # Prefer fewer terms unless more terms really help (guards against fitting noise).
            if err < best_err * (1 - 1e-9):
                best, best_err = coef, err
    return best


def profile_shapes(
    max_length: int, max_batch: int = 8, chunk: int | None = None, max_tokens: int | None = None
) -> list[tuple[int, int]]:
    """A small grid of (batch, length) shapes for a profile run, up to `max_length`.

    Lengths spread geometrically, every halving of `max_length` (short inputs matter: most
    completions are short), times three batch sizes: enough to separate every term.
    `max_tokens` drops the shapes wider than that many tokens (B*L), except batches of one: every
    length up to `max_length` is always measured. The planner then admits nothing beyond the
    largest shape kept (`CostModel.admits`).
    """
    top = max(1, int(max_length))
    # Every halving of the bound down to 1/512 of it (at least 16 tokens): a heavy-tailed workload
    # lives mostly far below the bound, and a grid of only long lengths would leave its short
    # inputs to a fit across a wide gap; the short shapes cost little to profile. The
    # shortest length also bounds how short a prefixed prediction's suffix may be taken.
    picks = [max(8, top // 32)] + [top >> k for k in range(10) if (top >> k) >= 16]
    if chunk and chunk < top:
        picks += [max(1, chunk // 2), chunk]  # both sides of the chunk's knee
    lengths = sorted({max(1, min(top, v)) for v in picks})
    batches = sorted({1, max(1, max_batch // 2), max(1, max_batch)})
    return [(b, l) for l in lengths for b in batches if b == 1 or max_tokens is None or b * l <= max_tokens]


def prefix_profile_shapes(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(B, L, prefix) passes that measure the shared prefix's cost, from a profile grid.

    At the three longest lengths, a batch of one and the narrowest wider batch profiled there,
    each with a prefix of half the length; at the longest, also one of seven eighths (a long
    prompt and a short completion, the common case). A handful of passes, inside the profiled
    extents. The rate is per row, so two batch sizes separate it; the widest batch at the longest
    length (16 x 8,192 tokens for DPO) would add minutes to a cold start on a CPU for nothing.
    """
    lengths = sorted({l for _, l in shapes if l >= 8})[-3:]
    out: set[tuple[int, int, int]] = set()

    def narrow(l: int) -> int:
        return min((b for b, ll in shapes if ll == l and b > 1), default=1)

    for l in lengths:
        for b in {1, narrow(l)}:
            out.add((b, l, l // 2))
    if lengths:
        top = lengths[-1]
        out.add((narrow(top), top, top - max(1, top // 8)))
    return sorted(out)


def _measure_all(items: Sequence[tuple[int, ...]], make: Callable[..., Callable[[], object]],
                 measure: Callable[[Callable[[], object]], int], what: str) -> list[tuple[int, ...]]:
    """Each item (B, L, ...) with the peak of `measure(make(*item))` appended. `make` runs before
    the measurement (a shared prefix's pass) and returns what is measured. An item that runs out
    of (real) memory is skipped and logged: a profile must not crash the load on a device that is
    already tight; the plan then never reaches that size.
    """
    samples: list[tuple[int, ...]] = []
    skipped: list[tuple[int, ...]] = []
    for item in items:
        try:
            samples.append((*item, int(measure(make(*item)))))
            continue
        except torch.OutOfMemoryError:
            skipped.append(item)
        gc.collect()  # after the OOM, outside the except block: its frames no longer pin the tensors
    if skipped:
        log.warning("profile: %s %s ran out of memory and were skipped", what, skipped)
    return samples


def profile(
    run: Callable[[int, int], object],
    measure: Callable[[Callable[[], object]], int],
    shapes: Sequence[tuple[int, int]],
    chunk: int | None = None,
    chunk_rows: bool = False,
    *,
    prefix_run: Callable[[int, int, int], Callable[[], object]] | None = None,
    lone_run: Callable[[int], object] | None = None,
) -> CostModel:
    """Measure `run(B, L)` at each shape with `measure` (returns peak bytes) and fit a cost model.

    `prefix_run(B, L, P)`: runs a shared prefix of P tokens and returns the pass over the rest of
    the B x L batch; that pass is measured at `prefix_profile_shapes(shapes)` to fit the model's
    `prefix_rate` and `prefix_cross` (only the suffix pass is measured, as scoring runs the
    prefix before its batches are planned). `lone_run(L)`: one unpadded input of L tokens,
    measured at every length profiled alone, fitted as the model's `lone`.
    """
    samples = _measure_all(shapes, lambda b, l: lambda: run(b, l), measure, "shapes")
    if not samples:
        raise torch.OutOfMemoryError(f"profile: every shape ran out of memory ({list(shapes)})")
    cost = CostModel(chunk=chunk, chunk_rows=chunk_rows).fit(samples)  # type: ignore[arg-type]
    if prefix_run is not None:
        kept = [(b, l) for b, l, _ in samples]
        prefixed = _measure_all(prefix_profile_shapes(kept), prefix_run, measure, "prefixed passes")
        cost.fit_prefix(prefixed)  # type: ignore[arg-type]
    if lone_run is not None:
        alone = sorted({(1, l) for b, l, _ in samples if b == 1})
        measured = _measure_all(alone, lambda b, l: lambda: lone_run(l), measure, "lone inputs")
        if measured:
            cost.lone = CostModel().fit(measured)  # type: ignore[arg-type]  # `admits` is the main fit's
    return cost


# -- the planner: batches packed against the cost model ------------------------------------
def plan_limit(budget_bytes: float, cost: CostModel, margin: float) -> float:
    """The share of the budget a plan may fill for this cost model."""
    return budget_bytes * margin * cost.trust


def max_fitting_length(cost: CostModel, budget_bytes: float, margin: float, upper: int) -> int:
    """The longest single input (batch of 1) predicted to fit, at most `upper`; 0 if none does.

    Never longer than the longest profiled length: past it the prediction would be a guess.
    """
    limit = plan_limit(budget_bytes, cost, margin)
    ext = cost.extents()
    return largest(lambda n: cost.predict(1, n) <= limit, upper if ext is None else min(upper, ext[1]))


def largest(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [0, upper] for which `fits(n)` holds (by bisection: `fits` holds up to some n); 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


PADDING_SLACK = 0.25
"""The share of a padded rectangle that may be padding (`padding_groups`, `plan_batches(slack=)`)."""


def wastes_too_much(count: int, longest: int, tokens: int, slack: float) -> bool:
    """Whether `count` inputs of `tokens` real tokens padded to `longest` waste more than `slack`."""
    return count * longest > (1.0 + slack) * tokens


def padding_groups(lengths: Sequence[int], slack: float = PADDING_SLACK) -> list[list[int]]:
    """Split a batch into groups whose padded rectangle wastes at most `slack` of it.

    The planner packs by memory; with a generous budget it may put a 40-token and an 8,000-token
    input together, which pays 8,000 positions for both. Splitting further only lowers memory.
    Returns lists of positions into `lengths`, ascending by length.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return greedy_groups(order, lengths, lambda count, longest, tokens: wastes_too_much(count, longest, tokens, slack))


def greedy_groups(order: Sequence[int], lengths: Sequence[int],
                   closes: Callable[[int, int, int], bool]) -> list[list[int]]:
    """Walk `order` (ascending by length) and start a new group wherever `closes(count, longest,
    tokens)` says the current one may not take the next input (count, longest and real tokens
    with it). The one greedy pass both the padding split and the batch planner run."""
    groups: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        n = max(1, lengths[i])  # ascending order: the newcomer is the longest
        if cur and closes(len(cur) + 1, n, tokens + n):
            groups.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        groups.append(cur)
    return groups


def plan_batches(
    lengths: Sequence[int],
    cost: CostModel,
    budget_bytes: float,
    *,
    margin: float = 0.9,
    max_batch: int | None = None,
    largest_first: bool = False,
    slack: float | None = None,
    prefix: int = 0,
    rows: Callable[[int, int], int] | None = None,
) -> list[list[int]]:
    """Group input indices into batches whose padded rectangle is predicted to fit the budget.

    Batches hold indices into `lengths`, each batch sorted by ascending length. Callers cut inputs
    to `max_fitting_length` first; an input that still does not fit alone gets a batch of its own
    (the OOM guard then handles it). `largest_first` returns the batch with the largest predicted
    peak first: a wrong prediction fails fast, and the caching allocator reserves its biggest
    block once instead of growing (and fragmenting) step by step. `slack`: also close a batch
    whose padding would pass that share (see the module docstring). `prefix`: the inputs' shared
    prefix, run before the batches (`CostModel.predict(prefix=)`). `rows(count, longest)`: the rows a
    batch of `count` inputs really runs as, filler rows included (a scorer whose passes have a fixed
    number of rows, `Pass.rows`); the batch is predicted at that many rows.
    """
    limit = plan_limit(budget_bytes, cost, margin)
    ran = rows if rows is not None else (lambda count, longest: count)

    def closes(count: int, longest: int, tokens: int) -> bool:
        fits = cost.predict(ran(count, longest), longest, prefix) <= limit and cost.admits(ran(count, longest), longest)
        padded = slack is not None and wastes_too_much(count, longest, tokens, slack)
        return not fits or padded or (max_batch is not None and count > max_batch)

    batches = greedy_groups(sorted(range(len(lengths)), key=lambda i: (lengths[i], i)), lengths, closes)
    if largest_first:
        batches.sort(key=lambda b: -cost.predict(ran(len(b), max(lengths[b[-1]], 1)), max(lengths[b[-1]], 1), prefix))
    return batches
