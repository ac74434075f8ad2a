"""DPO's chunk policy: how many rows a pass holds at once, chosen at load and per call from the budget.

Two knobs trade speed for memory and never change a number (every setting gives the same scores up
to float32 rounding): the logits chunk (rows of the reused `[rows, V]` float32 buffer of
`dpo_numerics.chunked_logprobs`) and, for a model running blocked attention
(`scorers.attention`), the attention block (query rows scored against all keys at once; per layer
`heads x rows x L` float32 instead of `heads x L x L`).

At load the fastest logits chunk up to the `logits_chunk` cap is measured (`ChunkPolicy.tune`) and
profiled; when the budget cannot hold the longest admitted input at it, the smaller settings it
needs are profiled too, still at load (`ChunkPolicy.measure_for_budget`: the attention block
halved first, down to `attention.MIN_BLOCK` rows, then the logits chunk, down to 16 rows; cached
with the calibration). Per step the memory manager keeps the tuned setting while the budget holds
the longest input, else takes the first measured smaller one that does (`MemoryManager.run_pass`);
nothing is profiled inside a step: what no measured setting holds is cut (`truncated`). A setting
is only used with a cost model measured at it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterator

import torch

from rewardstack._memory.calibration import Profile
from rewardstack._memory.costmodel import CostModel, max_fitting_length
from rewardstack._scorers.attention import MIN_BLOCK, AttentionChoice
from rewardstack._scorers.dpo_numerics import LogitHead, chunked_logprobs

log = logging.getLogger("rewardstack.scorers.dpo")

MIN_CHUNK = 16


class ChunkPolicy:
    """The logits chunk and attention block one DPO scorer runs with, and their cost models.

    `memory` is the runtime's memory manager; `profile(b, length)` is the scorer's profile pass
    (it reads `chunk` and the attention's rows when it runs). `costs[(chunk, rows)]` is the cost
    model measured at that setting (`rows` None: the model's own attention); `names` maps the
    calibration's name of each smaller setting measured, under which the memory manager keeps its
    cost model, to the setting.
    """

    def __init__(self, name: str, memory: Any, profile: Callable[[int, int], None], *, max_chunk: int,
                 calib_len: int, attention: AttentionChoice) -> None:
        self.name, self.memory, self.profile = name, memory, profile
        self.max_chunk, self.calib_len = max_chunk, calib_len
        self.attention = attention
        self.chunk = self.tuned_chunk = max_chunk
        self.tuned_rows = attention.rows
        self.timings: dict[int, float] = {}
        self.costs: dict[tuple[int, int | None], CostModel] = {}
        self.names: dict[str, tuple[int, int | None]] = {}

    def tune(self, head: LogitHead) -> dict[str, int]:
        """The fastest logits chunk (rows) up to `max_chunk`, measured at load where the head is now
        (placement may have moved it), as the calibration's tuned setting `{"chunk": rows}`.

        Each candidate (powers of two from 16, and `max_chunk`) runs `chunked_logprobs` itself
        (head, penalty bookkeeping, log-sum-exp) on a synthetic batch: 4 sequences of random ids,
        random hidden rows in place of the body's, 2 x `max_chunk` scored rows in all; the best of
        two runs counts (kept in `timings`). The choice changes speed only: every chunk size gives
        the same numbers up to float32 rounding, and memory stays bounded by the cap.
        """
        cands = sorted({c for c in (16, 32, 64, 128, 256, 512, 1024, 2048) if c < self.max_chunk} | {self.max_chunk})
        if len(cands) == 1:
            return {"chunk": cands[0]}
        w = head.weight
        device = w.device
        g = torch.Generator().manual_seed(0)
        b, n = 4, max(2 * cands[-1], 512) // 4 + 1
        ids = torch.randint(0, head.vocab, (b, n), generator=g).to(device)
        hidden = torch.randn(b, n, w.shape[1], generator=g).to(device=device, dtype=w.dtype)
        plens = torch.ones(b, dtype=torch.long, device=device)
        lengths = torch.full((b,), n, dtype=torch.long, device=device)
        hidden_at = lambda s, p: hidden[s, p]  # noqa: E731
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None  # a GPU runs asynchronously
        with torch.inference_mode():
            for c in cands:
                best = math.inf
                for _ in range(2):
                    sync(device)
                    t = time.perf_counter()
                    chunked_logprobs(hidden_at, head, ids, plens, lengths, c)
                    sync(device)
                    best = min(best, time.perf_counter() - t)
                self.timings[c] = best
        return {"chunk": min(cands, key=self.timings.__getitem__)}

    def apply(self, settings: dict) -> None:
        """The tuned logits chunk, measured now or read from the calibration cache."""
        self.chunk = self.tuned_chunk = int(settings.get("chunk", self.max_chunk))

    def ladder(self) -> Iterator[tuple[int, int | None]]:
        """The settings below the tuned one, in the order they are tried: the attention block
        halved first (at long inputs it is the larger term), down to `attention.MIN_BLOCK` rows,
        then the logits chunk, down to `MIN_CHUNK` rows."""
        chunk, rows = self.tuned_chunk, self.tuned_rows
        while chunk > MIN_CHUNK or (rows is not None and rows > MIN_BLOCK):
            if rows is not None and rows > MIN_BLOCK:
                rows //= 2
            else:
                chunk //= 2
            yield chunk, rows

    def measure_for_budget(self) -> None:
        """Profile, at load, the smaller settings the budget needs to hold one input of `calib_len`
        tokens (the calibration queue runs after the budget is set): the first setting whose fit
        holds it ends the ladder. A setting whose cost is guessed (the tuned fit with the smaller
        chunk put in) not to hold it either is skipped unprofiled; the last one is always
        profiled. A step then only chooses among the settings measured here (`settings`)."""
        memory = self.memory
        self.costs[(self.tuned_chunk, self.tuned_rows)] = base = memory.cost_model(self.name)
        self.names = {}
        if memory.budget_bytes is None:
            return
        cap = memory.length_cap(self.name, self.calib_len)
        for chunk, rows in self.ladder():
            if cap >= self.calib_len:
                break
            guess = CostModel.from_dict({**base.to_dict(), "chunk": chunk})
            if rows == self.tuned_rows and chunk > MIN_CHUNK and max_fitting_length(
                    guess, memory.free_bytes(), memory.margin, self.calib_len) < self.calib_len:
                continue  # even the guess says no: the next setting, without profiling this one
            # The calibration's name of the setting (at the load-time attention block, the chunk alone).
            name = f"{self.name}[chunk={chunk}" + ("]" if rows == self.tuned_rows else f",block={rows}]")
            log.info("%s: profiling the %d-row logits chunk%s the budget needs", self.name, chunk,
                     f" and {rows}-row attention blocks" if rows is not None else "")
            self.use((chunk, rows))
            self.costs[(chunk, rows)] = memory.calibrate(Profile(name, self.profile, max_length=self.calib_len,
                                                                 max_batch=16, chunk=chunk, chunk_rows=True))
            self.names[name] = (chunk, rows)
            cap = max(cap, memory.length_cap(name, self.calib_len))
        self.use((self.tuned_chunk, self.tuned_rows))

    def use(self, setting: str | tuple[int, int | None]) -> None:
        """Run with a setting: its logits chunk and attention rows, by value or by calibration name
        (the scorer's own name: the tuned setting)."""
        if setting == self.name:
            setting = (self.tuned_chunk, self.tuned_rows)
        chunk, rows = self.names[setting] if isinstance(setting, str) else setting
        self.chunk = chunk
        if rows is not None:
            self.attention.set_rows(rows)
