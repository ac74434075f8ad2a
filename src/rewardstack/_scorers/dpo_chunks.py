"""DPO's chunk policy: how many rows a pass holds at once, chosen at load and per call from the budget.

Two knobs trade speed for memory and never change a number (every setting gives the same scores up
to float32 rounding): the logits chunk (rows of the reused `[rows, V]` float32 buffer of
`dpo_numerics.chunked_logprobs`) and, for a model running blocked attention
(`scorers.attention`), the attention block (query rows scored against all keys at once; per layer
`heads x rows x L` float32 instead of `heads x L x L`).

At load the fastest logits chunk up to the `logits_chunk` cap is measured (`tune_chunk`). Per call,
`ChunkPolicy.fit(longest)` keeps both at their load-time values while the budget holds the longest
input; otherwise it halves the attention block first (at long inputs it is the larger term), down
to `attention.MIN_BLOCK` rows, then the logits chunk, down to 16 rows; only then are inputs cut. A
setting is only used with a cost model measured at it: each is profiled the first time it would be
chosen (and cached with the calibration); the fit measured at the load-time setting, with the
smaller chunk put in, is only a first guess that decides which settings to skip.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import torch

from rewardstack._memory.calibrating import Profile
from rewardstack._memory.costmodel import CostModel, ProfileCapped
from rewardstack._scorers.attention import MIN_BLOCK, AttentionChoice
from rewardstack._scorers.dpo_numerics import LogitHead, chunked_logprobs

log = logging.getLogger("rewardstack.scorers.dpo")

MIN_CHUNK = 16


def tune_chunk(head: LogitHead, device: torch.device, max_chunk: int, timings: dict[int, float]) -> int:
    """The fastest logits chunk (rows) up to `max_chunk`, measured on this machine at load.

    Each candidate (powers of two from 16, and `max_chunk`) runs `chunked_logprobs` itself
    (head, penalty bookkeeping, log-sum-exp) on a synthetic batch: 4 sequences of random ids,
    random hidden rows in place of the body's, 2 x `max_chunk` scored rows in all; the best of
    two runs counts (written into `timings`). The choice changes speed only: every chunk size gives
    the same numbers up to float32 rounding, and memory stays bounded by the cap.
    """
    cands = sorted({c for c in (16, 32, 64, 128, 256, 512, 1024, 2048) if c < max_chunk} | {max_chunk})
    if len(cands) == 1:
        return cands[0]
    w = head.weight
    g = torch.Generator().manual_seed(0)
    b, n = 4, max(2 * cands[-1], 512) // 4 + 1
    ids = torch.randint(0, head.vocab, (b, n), generator=g).to(device)
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
                chunked_logprobs(hidden_at, head, ids, plens, lengths, c)
                if device.type == "cuda":  # pragma: no cover
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t)
            timings[c] = best
    return min(cands, key=lambda c: timings[c])


class ChunkPolicy:
    """The logits chunk and attention block one DPO scorer runs with, and their cost models.

    `memory` is the runtime's memory manager; `profile(b, length)` is the scorer's profile pass
    (it reads `chunk` and the attention's rows when it runs). `costs[(chunk, rows)]` is the cost
    model measured at that setting (`rows` None: the model's own attention).
    """

    def __init__(self, name: str, memory: Any, profile: Callable[[int, int], None], *, max_chunk: int,
                 max_len: int, calib_len: int, attention: AttentionChoice) -> None:
        self.name, self.memory, self.profile = name, memory, profile
        self.max_chunk, self.max_len, self.calib_len = max_chunk, max_len, calib_len
        self.attention = attention
        self.chunk = self.tuned_chunk = max_chunk
        self.tuned_rows = attention.rows
        self.timings: dict[int, float] = {}
        self.costs: dict[tuple[int, int | None], CostModel] = {}
        self.capped: set[tuple[int, int | None]] = set()
        """Settings whose mid-run profile hit `memory.profile_limit_s`: never profiled again in this process."""

    def apply(self, settings: dict) -> None:
        """The tuned logits chunk, measured now or read from the calibration cache."""
        self.chunk = self.tuned_chunk = int(settings.get("chunk", self.max_chunk))

    def calibration_name(self, chunk: int, rows: int | None) -> str:
        """The calibration's name of a setting (the load-time attention block keeps the old name)."""
        if rows == self.tuned_rows:
            return f"{self.name}[chunk={chunk}]"
        return f"{self.name}[chunk={chunk},block={rows}]"

    def fit(self, longest: int) -> int:
        """Shrink the attention block, then the logits chunk, not the input, while the budget
        cannot hold `longest` tokens. Returns the length cap that remains."""
        memory = self.memory
        if memory.budget_bytes is None:  # nothing to fit: the tuned setting, inputs cut at max_len only
            self.chunk = self.tuned_chunk
            if self.tuned_rows is not None:
                self.attention.set_rows(self.tuned_rows)
            return self.max_len
        self.use(self.tuned_chunk, self.tuned_rows)
        cap = self._cap()
        chunk, rows = self.tuned_chunk, self.tuned_rows
        good = (chunk, rows)  # the smallest setting tried that has a measured cost model
        base = self.costs[(self.tuned_chunk, self.tuned_rows)]
        while cap < longest and (chunk > MIN_CHUNK or (rows is not None and rows > MIN_BLOCK)):
            if rows is not None and rows > MIN_BLOCK:
                rows //= 2
            else:
                chunk //= 2
            # The load-time fit with this chunk's terms: a cheap first guess (the block's effect
            # is not in it, so a smaller block is always profiled).
            memory.cost_models[self.name] = CostModel.from_dict({**base.to_dict(), "chunk": chunk})
            if rows == self.tuned_rows and self._cap() < longest and chunk > MIN_CHUNK:
                continue  # even the guess says no: try the next chunk without profiling this one
            if (chunk, rows) in self.capped or not self.use(chunk, rows):
                break  # its profile hit the time cap (now or before): smaller ones cost as much
            good = (chunk, rows)
            cap = self._cap()
        self.use(*good)
        return self._cap()

    def _cap(self) -> int:
        return min(self.max_len, self.memory.length_cap(self.name, self.max_len))

    def use(self, chunk: int, rows: int | None) -> bool:
        """Run with `chunk` logits rows and `rows` attention rows, and the cost model measured at them.

        A setting without one is profiled now, inside the step, under the manager's time cap
        (`profile_limit_s`, `[memory] profile_seconds`). Why a cap rather than profiling every
        setting at load: which settings a budget needs depends on the step's longest input and on
        what is live then (the shared prefix), so profiling them all at load would spend the worst
        case's minutes (three profiles, 880 s on a loaded 2-core CPU) at every cold start for
        settings most runs never need; the cap bounds the step instead, and a profile that ends is
        cached like the load-time ones, so it is paid once per machine. Returns False (nothing
        changed: the previous setting stays) when the cap stopped the profile."""
        memory = self.memory
        key0 = (self.tuned_chunk, self.tuned_rows)
        if key0 not in self.costs:  # the calibration's fit, however it was made
            self.costs[key0] = memory.cost_model(self.name)
        self.chunk = chunk
        if rows is not None:
            self.attention.set_rows(rows)
        if (chunk, rows) not in self.costs:
            what = f"the {chunk}-row logits chunk" + (f" and {rows}-row attention blocks" if rows is not None else "")
            limit = getattr(memory, "profile_limit_s", None)
            log.info("%s: profiling %s the budget needs%s", self.name, what,
                     f" (at most {limit:g}s)" if limit is not None else "")
            previous = memory.cost_models.get(self.name)
            try:
                self.costs[(chunk, rows)] = memory.calibrate(Profile(
                    self.calibration_name(chunk, rows), self.profile, max_length=self.calib_len, max_batch=16,
                    chunk=chunk, chunk_rows=True, limit_s=limit))
            except ProfileCapped as e:
                self.capped.add((chunk, rows))
                log.warning("%s: profiling %s stopped at its %gs cap ([memory] profile_seconds) after %d of %d "
                            "shapes: not used; inputs the budget cannot hold at the larger setting are cut",
                            self.name, what, e.limit_s, e.measured, e.shapes)
                if previous is not None:
                    memory.cost_models[self.name] = previous
                return False
        memory.cost_models[self.name] = self.costs[(chunk, rows)]
        return True
