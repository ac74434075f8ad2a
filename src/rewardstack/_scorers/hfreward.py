"""User-named HuggingFace sequence-classification reward models (`[rewards.<name>]`, family `hf_reward`).

The classifier scorer of the OpenAssistant model (`scorers.classifier._Classifier`: loading through
the lock file, the length bound, the pass-token cap, the memory layer's calibration) with what a
trainer's reward model needs: one text per input (a chat-templated string, or `messages` the
tokenizer's chat template renders here), cut at the length bound on the declared side and flagged,
and its first logit as the score.

Batch invariance (docs/TRAINERS.md, "The same input, the same score"): a row is padded to a width
that depends on its own length only (`pad_width`), and passes hold rows of one width. The number of
rows in a pass is part of every matrix product's shape too: MKL's strict mode (set when rewardstack
is imported, `rewardstack._reproducible`) keeps a row's bits whatever that number on the CPUs where
it holds; where the start-up check (`_scorers/invariance.py`) finds it does not, or the model's
`fixed_shapes` option is "on", every pass at a width has a fixed number of rows, filler rows added.
"""

from __future__ import annotations

import logging
import math
import threading
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rewardstack.config import ModelConfig
from rewardstack.errors import InputError
from rewardstack._memory.guard import Outcome
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import Runtime, ScoreRequest, ScoreResult, fill
from rewardstack._memory.calibration import no_budget
from rewardstack._reproducible import strict_state
from rewardstack._scorers.classifier import _Classifier, first_logit
from rewardstack._scorers.invariance import CANDIDATE_ROWS, Invariance, choose_rows, differing, probe

log = logging.getLogger("rewardstack.scorers")

Chat = Sequence[dict]
"""A conversation: `{"role", "content"}` messages."""


@dataclass
class Encoded:
    """One input tokenized for a model, before it joins a pass: its ids (cut at the model's length
    bound), whether they were cut, and the input and field it came from (re-read if the budget
    at run time holds fewer tokens than the bound)."""

    ids: Sequence[int]
    cut: bool
    item: Any
    field: str
    special: bool | None = None
    """Whether the tokenizer added its special tokens (`HfRewardScorer.encode`)."""


@dataclass
class Read:
    """One input as scored: the memory layer's outcome (its value the score), whether the input was
    cut at the length bound, and the tokens read."""

    outcome: Outcome
    cut: bool
    tokens: int


def pad_width(length: int, cap: int) -> int:
    """The padded width of a row of `length` ids: the first of 16, 24, 32, 48, 64, 96, ... above it
    (at least one pad position, so the attention mask is always built), at most `cap`."""
    width = 16
    while width <= length:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return min(width, cap)


def width_ladder(cap: int) -> list[int]:
    """Every width `pad_width` pads to under `cap`, ascending."""
    widths = [pad_width(0, cap)]
    while widths[-1] < cap:
        widths.append(pad_width(widths[-1], cap))
    return widths


class HfRewardScorer(_Classifier):
    """A sequence-classification reward model: one score (its first logit) per text."""

    kind = "reward"

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        # The side is the tokenizer's own setting, made when it loads: another table on the same
        # folder gets a tokenizer of its own side (scorers/loading.py).
        super().__init__(cfg.name, cfg, runtime, None, tokenizer_options={"truncation_side": cfg.options.truncation_side})
        tok = self.tokenizer
        if tok.pad_token_id is None and tok.eos_token_id is not None:
            self.pad_id = tok.eos_token_id  # how transformers batches a decoder without a pad token
        if self.model.config.pad_token_id is None:
            # A decoder's classification head finds each row's last token by the pad id; without one
            # it refuses batches of more than one row.
            self.model.config.pad_token_id = self.pad_id
        # A fast tokenizer's truncation settings live in its Rust object, which refuses a second
        # thread while one sets them ("Already borrowed"): requests tokenize one at a time.
        self._tokenizing = threading.Lock()
        self.fixed_rows: dict[int, int] | None = None
        """Width -> rows of every pass at that width (None: passes of up to `max_tokens`)."""
        self.mask_slot = False
        """At the cap width, a pass of several rows keeps one with a pad position (the check found an
        all-ones mask, which sdpa drops for another kernel, changes the bits)."""
        self.invariance = Invariance(cfg.options.fixed_shapes, "unavailable")
        enc.calibrate(self, first_logit, tune=cfg.options.max_batch_tokens is None, then=self.check_invariance)

    def encode(self, item: str | Chat, field: str, bound: int | None = None,
               special: bool | None = None) -> tuple[list[int], bool]:
        """The ids of one input, cut at `bound` tokens (default: the model's length bound), and
        whether it was cut; InputError naming `field` for an input that cannot be read or is empty.

        `special`: whether the tokenizer adds its special tokens (a BOS) to the text. By default a
        string gets them (vLLM's convention, and a plain transformers call's) and a chat the
        template rendered does not (the template writes them); `/get_reward` says no (OpenRLHF's
        serve_rm: its queries are chat-templated already).
        """
        tok = self.tokenizer
        default = True
        if not isinstance(item, str):
            if not self.cfg.options.chat_template or not getattr(tok, "chat_template", None):
                raise InputError(f"{self.name} takes plain text: its tokenizer has no chat template or its "
                                 "chat_template option is off; send the rendered text instead", field=field)
            try:
                item = tok.apply_chat_template(list(item), tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template's own error is the client's input
                raise InputError(f"the chat template refused these messages: {e}", field=field) from None
            if not item:
                raise InputError("the chat template renders these messages as an empty text: there is nothing to "
                                 "score", field=field)
            default = False
        special = default if special is None else special
        bound = self.max_length if bound is None else min(bound, self.max_length)
        try:
            with self._tokenizing:
                ids = tok(item, add_special_tokens=special)["input_ids"]
                cut = len(ids) > bound
                if cut:
                    ids = tok(item, add_special_tokens=special, truncation=True, max_length=bound)["input_ids"]
        except Exception as e:  # noqa: BLE001 - what the tokenizer cannot read fails its own request only
            raise InputError(f"the tokenizer cannot read this input ({type(e).__name__}: {e})", field=field) from None
        if not ids:
            raise InputError("is empty: there is nothing to score", field=field)
        return list(ids), cut

    def prepare(self, item: str | Chat, field: str, special: bool | None = None) -> Encoded:
        """One input tokenized ahead of its pass (on the caller's thread, not the device's), with
        `special` as `encode` takes it; InputError naming `field` if it cannot be."""
        ids, cut = self.encode(item, field, special=special)
        return Encoded(array("i", ids), cut, item, field, special)  # 4 bytes a token while it waits

    def score_groups(self, groups: Sequence[Sequence[tuple[str | Chat, str]]],
                     completions: Sequence[Sequence[int]] | None = None,
                     specials: Sequence[bool | None] | None = None) -> list[list[Read] | InputError]:
        """Every group's inputs (item, field name) in one pass through the memory layer: per group,
        a `Read` per input, or the InputError of its first bad input (the other groups are scored).
        `completions`: per group, the step's completion index of each input, for the memory
        layer's records; `specials`: per group, its inputs' `special` (`encode`: its route's
        tokenization convention)."""
        answers: list[list[Read] | InputError] = []
        rows: list[Encoded] = []
        kept: list[int] = []
        for g, group in enumerate(groups):
            try:
                special = specials[g] if specials is not None else None
                encoded = [self.prepare(item, field, special) for item, field in group]
            except InputError as e:
                answers.append(e)
                continue
            answers.append([])
            rows.extend(encoded)
            kept.append(g)
        reads = self.score_encoded(rows, [c for g in kept for c in completions[g]] if completions is not None else None)
        for g in kept:
            answers[g], reads = reads[:len(groups[g])], reads[len(groups[g]):]
        return answers

    def score_encoded(self, rows: Sequence[Encoded], completions: Sequence[int] | None = None) -> list[Read]:
        """A `Read` per input tokenized ahead (`prepare`), all in one pass through the memory layer.

        Inputs longer than the budget holds alone (`MemoryManager.run_pass`'s allowance) are read
        again at that cap; identical inputs are one row.
        """
        where: list[tuple[int, bool, int]] = []

        def build(allowance: Allowance) -> Pass:
            index: dict[tuple[int, ...], int] = {}
            first: list[int | None] = []  # per row: the completion it was first read for
            where.clear()
            for k, row in enumerate(rows):
                ids, cut = row.ids, row.cut
                if len(ids) > allowance.cap:
                    ids, cut = self.encode(row.item, row.field, allowance.cap, row.special)
                at = index.setdefault(tuple(ids), len(index))
                if at == len(first):
                    first.append(completions[k] if completions is not None else None)
                where.append((at, cut, len(ids)))
            unique = [list(r) for r in index]
            return Pass([pad_width(len(r), self.max_length) for r in unique], self._forward(unique),
                        max_batch=self.max_batch, completions=first if completions is not None else None,
                        rows=self._planned_rows())

        outcomes = self.runtime.memory.run_pass(self.name, build, upper=self.max_length) if rows else []
        return [Read(outcomes[at], cut, tokens) for at, cut, tokens in where]

    def pass_rows(self, width: int) -> int:
        """Rows of one pass at `width`: the fixed count, or as many as `max_tokens` holds."""
        return self.fixed_rows[width] if self.fixed_rows is not None else max(1, self.max_tokens // width)

    def _passes(self, members: list[int], rows: Sequence[Sequence[int]], width: int) -> list[tuple[list[int], int]]:
        """The passes of `members` (rows padded to `width`): each pass's rows and its filler rows."""
        size = self.pass_rows(width)
        full = [i for i in members if len(rows[i]) == width]  # only at the cap: no pad position
        if not (self.mask_slot and full and size > 1):
            groups = [members[k:k + size] for k in range(0, len(members), size)]
        else:  # one slot of every pass for a row with a pad position: a shorter row, else a filler
            short = [i for i in members if len(rows[i]) < width]
            groups = []
            while full or short:
                group, short = short[:1], short[1:]
                group, full = group + full[:size - 1], full[size - 1:]
                group, short = group + short[:size - len(group)], short[size - len(group):]
                groups.append(group)
        if self.fixed_rows is not None:
            return [(g, size - len(g)) for g in groups]
        return [(g, int(self.mask_slot and size > 1 and all(len(rows[i]) == width for i in g))) for g in groups]

    def _forward(self, rows: Sequence[Sequence[int]]) -> Callable[[list[int]], list[Any]]:
        """The memory layer's forward over `rows`: the first logit of each row asked for, passes of
        one padded width each (see the module's note on batch invariance). A split batch (the OOM
        guard's halves) runs the same shapes: its passes are filled back to their rows."""
        widths = [pad_width(len(r), self.max_length) for r in rows]

        def forward(idx: list[int]) -> list[Any]:
            values: dict[int, Any] = {}
            by_width: dict[int, list[int]] = {}
            for i in idx:
                by_width.setdefault(widths[i], []).append(i)
            for width, members in sorted(by_width.items()):
                for group, fill in self._passes(members, rows, width):
                    padded = [list(rows[i]) for i in group] + [list(rows[group[0]][:1])] * fill
                    batch = enc.pad_batch(self.model, padded, self.pad_id, width=width)
                    values.update(zip(group, first_logit(self.model(**batch), batch["attention_mask"]).float().cpu()))
            return [values[i] for i in idx]

        return forward

    def _planned_rows(self) -> Callable[[int, int], int] | None:
        """What a planned batch of (count, longest) runs as, in rows of `longest` (`Pass.rows`): with
        fixed shapes, at least the fixed rows of every width up to it, in tokens."""
        fixed = self.fixed_rows
        if fixed is None:
            return None
        return lambda count, longest: max([count] + [math.ceil(n * w / longest) for w, n in fixed.items() if w <= longest])

    # -- the start-up check ----------------------------------------------------------------------
    def check_invariance(self) -> Invariance:
        """Score a probe alone and in full passes at start-up (`invariance.differing`); where the
        bits differ, turn on fixed shapes (`fixed_shapes = "auto"`) or warn ("off"); with fixed
        shapes, a width that still differs gets one row a pass (the same tensor whatever the company)."""
        mode = self.cfg.options.fixed_shapes
        inv = self.invariance = Invariance(mode, strict_state() if self.runtime.device.type == "cpu" else "unavailable")
        ladder = width_ladder(self.max_length)
        with torch.inference_mode(), no_budget(self.runtime.memory.tracker, enter=True):
            if mode == "on":
                self._fix_shapes(ladder)
            checked = ladder if self.fixed_rows is not None else sorted({ladder[0], ladder[len(ladder) // 2], ladder[-1]})
            found = self._differing(checked)
            if found and self.fixed_rows is None:
                inv.found = f"bits differed in full passes at widths {found}"
                if mode == "auto":
                    self._fix_shapes(ladder)
                    found = self._differing(ladder)
            if found and self.fixed_rows is not None:
                if self.max_length in found:
                    self.mask_slot = True  # an all-ones mask at the cap may be what moved them
                    found = self._differing(found)
                for w in found:
                    self.fixed_rows[w] = 1
                inv.found = (inv.found + "; " if inv.found else "") + f"one row a pass at widths {found}"
        inv.fixed_shapes, inv.rows = self.fixed_rows is not None, dict(self.fixed_rows or {})
        inv.same_bits = not (mode == "off" and inv.found)
        inv.found = inv.found or "the same bits alone and in full passes"
        say = log.warning if not inv.same_bits or (inv.fixed_shapes and mode == "auto") else log.info
        rows = f", rows per width {inv.rows}" if inv.rows else ""
        # Formatted here: the service's repeat filter keys on the template, and each model's line is news.
        say(f"{self.name}: the same input, the same score: {inv.found} (MKL strict mode {inv.strict_blas}; "
            f"fixed shapes {'on' if inv.fixed_shapes else 'off'}{rows})")
        return inv

    def _differing(self, widths: Sequence[int]) -> list[int]:
        fixed = self.fixed_rows
        widths = [w for w in widths if fixed is None or fixed[w] > 1]  # one row a pass is the same tensor alone
        return differing(lambda rows: self._forward(rows)(list(range(len(rows)))), self.tokenizer, widths,
                         self.max_length, self.pass_rows)

    def _fix_shapes(self, ladder: list[int]) -> None:
        """Fixed rows per width, measured once per checkpoint and machine (the calibration cache)."""
        memory = self.runtime.memory

        def most(width: int) -> int:  # the pass-token cap, the batch size and the memory plan
            top = min(self.max_tokens // width, self.max_batch or CANDIDATE_ROWS[-1])
            return max(n for n in CANDIDATE_ROWS if n == 1 or (n <= top and memory.fits(self.name, n, width)))

        def run(n: int, width: int) -> None:
            batch = enc.pad_batch(self.model, [probe(self.tokenizer, width - 1)] * n, self.pad_id, width=width)
            first_logit(self.model(**batch), batch["attention_mask"]).float().cpu()

        chosen = memory.remembered(self.name, "fixed_rows", lambda: sorted(choose_rows(run, ladder, most).items()))
        rows = {int(w): int(n) for w, n in chosen}
        self.fixed_rows = {w: min(rows.get(w, 1), most(w)) for w in ladder}  # the cache's, within today's budget

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        """The validator-step interface: each live completion after its prompt, as one text."""
        [reads] = self.score_groups([[(request.prompt + str(request.completions[i]), f"completions[{i}]") for i in live]],
                                    [live])
        if isinstance(reads, InputError):
            raise reads
        return fill(result, live, [read.outcome for read in reads], float, cut=[read.cut for read in reads])


build = HfRewardScorer
"""The registry's builder: the scorer of one `[rewards.<name>]` model."""

