"""User-named HuggingFace sequence-classification reward models (`[rewards.<name>]`, family `hf_reward`).

The classifier scorer of the OpenAssistant model (`scorers.classifier._Classifier`: loading through
the lock file, the length bound, the pass-token cap, the memory layer's calibration) with what a
trainer's reward model needs: one text per input (a chat-templated string, or `messages` the
tokenizer's chat template renders here), cut at the length bound on the declared side and flagged,
and its first logit as the score.

Batch invariance: a row is padded to a width that depends on its own length only (`pad_width`),
passes hold rows of one width, and every pass has a padded row (`forward`), so its numbers are
the same whatever else is in the batch (on CPU bit for bit; docs/TRAINERS.md says what holds on a
GPU). Padding each pass to its longest row instead changes the low bits with the company.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rewardstack.config import ModelConfig
from rewardstack.errors import InputError
from rewardstack._memory.guard import Outcome
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.base import Runtime, ScoreRequest, ScoreResult, fill
from rewardstack._scorers.classifier import _Classifier, first_logit

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
        enc.calibrate(self, first_logit, tune=cfg.options.max_batch_tokens is None)

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
                        max_batch=self.max_batch, completions=first if completions is not None else None)

        outcomes = self.runtime.memory.run_pass(self.name, build, upper=self.max_length) if rows else []
        return [Read(outcomes[at], cut, tokens) for at, cut, tokens in where]

    def _forward(self, rows: Sequence[Sequence[int]]) -> Callable[[list[int]], list[Any]]:
        """The memory layer's forward over `rows`: the first logit of each row asked for, passes of
        one padded width each (see the module's note on batch invariance)."""
        widths = [pad_width(len(r), self.max_length) for r in rows]

        def forward(idx: list[int]) -> list[Any]:
            values: dict[int, Any] = {}
            by_width: dict[int, list[int]] = {}
            for i in idx:
                by_width.setdefault(widths[i], []).append(i)
            for width, members in sorted(by_width.items()):
                per_pass = max(1, self.max_tokens // width)
                for k in range(0, len(members), per_pass):
                    group = members[k:k + per_pass]
                    padded = [list(rows[i]) for i in group]
                    if all(len(r) == width for r in padded):  # only at the cap: keep the masked path
                        padded.append(padded[0][:1])
                    batch = enc.pad_batch(self.model, padded, self.pad_id, width=width)
                    values.update(zip(group, first_logit(self.model(**batch), batch["attention_mask"]).float().cpu()))
            return [values[i] for i in idx]

        return forward

    def _score_live(self, request: ScoreRequest, live: list[int], result: ScoreResult) -> ScoreResult:
        """The validator-step interface: each live completion after its prompt, as one text."""
        [reads] = self.score_groups([[(request.prompt + str(request.completions[i]), f"completions[{i}]") for i in live]],
                                    [live])
        if isinstance(reads, InputError):
            raise reads
        return fill(result, live, [read.outcome for read in reads], float, cut=[read.cut for read in reads])


build = HfRewardScorer
"""The registry's builder: the scorer of one `[rewards.<name>]` model."""

