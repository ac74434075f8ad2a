"""Shared machinery of the scorers: every family's input bound and padding, and the encoders' passes.

`sane_max_length` is the spec's reading of a model's length bound (DPO, Reciprocate, the judge): the
config's `max_length`, else the tokenizer's `model_max_length` where it is a real number
(tokenizers without one report 1e30), else the model config's position limit; `pad_rows` pads
token-id rows into one batch tensor (every family). For the encoders (OpenAssistant, NSFW,
relevance, diversity): length bounds that never trust an absurd tokenizer `model_max_length`,
right-padded batches built from token-id rows, the load-time calibration of a model's cost model,
and `rows_pass`: every row of a step as one pass of the memory manager, in as few forward passes as
the budget (and a per-pass token cap that keeps peak memory flat for very long inputs) allows.

The character bound: cut a text before tokenizing, where the cut provably keeps the tokens a
model's bound keeps.

A scorer whose model reads only the first `n` tokens of a text (OpenAssistant's completion side,
DPO, Reciprocate, Dahoas, the diversity/relevance second encoder) need not tokenize a megabyte to
throw all but `n` tokens away. `head_for_tokens(text, tokenizer, n)` returns a prefix of `text`
whose own tokens are exactly the first tokens of `text`'s, and more than `n` of them: so the first
`n` ids, and whether the text was longer than the bound, are the same as from the whole text, and
the model's value and status are unchanged. The derivation (docs/SEMANTICS.md, "Bounded work"):

1. Cut only at a *safe boundary*: position `p` with `text[p] == " "` (U+0020) and `text[p-1]` not
   whitespace; keep `text[:p]`.
2. The tokenizer is a fast (`tokenizers`) pipeline: added tokens are split out first, then a
   normalizer, a pre-tokenizer that splits the text into pieces, and a model run on each piece
   alone. For the whitelisted parts below, the pieces of `text[:p]` are exactly the pieces of
   `text` that end at or before `p`:
   - normalizers: per-character maps (BERT's clean-up, CJK spacing, lower-casing, accent
     stripping), Unicode NFC/NFD/NFKC/NFKD (a space is a starter that composes with nothing, so
     normalization never reaches across it), sentencepiece's precompiled map (NFKC-like, no entry
     spans a space), `Prepend` (start only), `Strip` (ends only: the head ends in a non-space),
     and `Replace` of a pattern without whitespace;
   - pre-tokenizers that split at that space: ByteLevel with its GPT-2 regex (a piece before a
     space never extends over it, and `\\s+(?!\\S)` only groups whitespace), BERT's and the
     whitespace splitters (whitespace ends a piece), Metaspace with splitting (the space becomes
     `▁`, which starts a new piece), and sequences of these; digits/punctuation splitters too;
   - models (BPE, WordPiece, Unigram, WordLevel) see one piece at a time, so equal pieces give
     equal tokens, in order;
   - no added token holds whitespace (else the cut could split one).
3. Tokens never vanish across pieces and every piece gives at least one token, so the head's
   tokens are a prefix of the text's; we tokenize the head and check it has more than `n`.

A tokenizer outside that list (a slow tokenizer; LLaMA's, which runs BPE over the whole text with
no pre-tokenizer, so a merge may cross any space) gets no cut: it reads the text up to the
stack's `[input] max_chars` (`Status.CUT` past it). Cost: the head is searched at 8(n+1)
characters, doubling, so the work is a small multiple of what the bound keeps.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
from typing import Any, Callable, Sequence

import torch

from rewardstack._memory.calibration import Profile
from rewardstack._memory.costmodel import greedy_groups
from rewardstack._memory.manager import Pass

SANE_MAX_LENGTH = 100_000  # a tokenizer claiming more than this (DeBERTa-v3 says 1e30) is not believed
# Families whose position ids start at padding_idx + 1: two position rows are never usable.
POSITION_OFFSET_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "bart"})


CPU_PASS_TOKENS = 4096
"""Tokens of one padded pass on CPU in the memory plan, before tuning (at least one window): a
CPU pass costs a few ms of fixed work (module calls, thread hand-offs), a small share at 4,096
tokens even for a tiny model, while one window of a short-bounded model (64 tokens) is one row a
pass. Measured: a 6-layer, 384-wide Llama reward model served 7.7 samples/s at one 512-token
window a pass and 11.0 at 4,096 (issue 48)."""
MAX_PASS_ROWS = 64
"""Most rows one pass takes (profiled shapes reach this for short inputs)."""
SHRINK_STEPS = 2
"""Halvings below the plan's pass size that CPU tuning may take (4,096 -> 2,048 -> 1,024)."""
SLOWER_BY = 1.10
"""How much slower a pass must be than one of half its size, in every timing round and in the best
of each, before tuning takes the smaller one (a wider pass is the plan's; 10% is about the timing
noise between rounds on a shared 2-core machine)."""
ROUNDS = 3
"""Interleaved timing rounds of each comparison (and again of its re-check)."""


def default_pass_tokens(bound: int, device: torch.device) -> int:
    """Tokens one padded pass may hold in the memory plan (the memory budget bounds the planned
    batches further): `CPU_PASS_TOKENS` on CPU (at least one window), where `tune_pass_tokens`
    may then halve it at load when it is measurably slower; 16 windows on an accelerator, where
    bigger passes keep it busy and it is not tuned."""
    return max(bound, CPU_PASS_TOKENS) if device.type == "cpu" else 16 * bound


def position_limit(config: Any) -> int | None:
    """The longest input the model's position embeddings accept (None: relative positions only)."""
    if getattr(config, "relative_attention", False) and not getattr(config, "position_biased_input", True):
        return None  # DeBERTa-v3: no absolute positions, any length runs (at quadratic cost)
    mpe = getattr(config, "max_position_embeddings", None)
    if not isinstance(mpe, int) or mpe <= 0:
        return None
    return mpe - (2 if getattr(config, "model_type", "") in POSITION_OFFSET_TYPES else 0)


def resolve_max_length(tokenizer: Any, config: Any, override: int | None = None, default: int | None = None) -> int:
    """The input-length bound in tokens: override, else `default`, else a sane tokenizer value,
    else the config's position limit (512 if nothing says). Never above the position limit."""
    limit = position_limit(config)
    if override:
        bound = int(override)
    elif default:
        bound = int(default)
    else:
        tok_max = getattr(tokenizer, "model_max_length", None)
        if isinstance(tok_max, (int, float)) and 0 < tok_max <= SANE_MAX_LENGTH:
            bound = int(tok_max)
        else:
            bound = limit or 512
    return max(4, min(bound, limit) if limit else bound)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are now (placement may move a model between calls)."""
    return next(model.parameters()).device


def accepts(model: torch.nn.Module, arg: str) -> bool:
    """Whether `model.forward` takes keyword `arg` (MPNet takes no token_type_ids)."""
    return arg in inspect.signature(model.forward).parameters


def pad_batch(
    model: torch.nn.Module,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    types: Sequence[Sequence[int]] | None = None,
    width: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask (/ token_type_ids) on the model's device, to the longest
    row or to `width`."""
    ids, mask = pad_rows(rows, pad_id, width=width)
    device = model_device(model)
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if types is not None and accepts(model, "token_type_ids"):
        batch["token_type_ids"] = pad_rows(types, 0, width=ids.shape[1])[0].to(device)
    return batch


def calibrate(owner: Any, head: Callable[[Any, torch.Tensor], torch.Tensor], *, tune: bool,
              then: Callable[[], None] | None = None) -> None:
    """Fit the cost model of the encoder scorer `owner` (its `runtime`, `name`, `model`, `max_length`
    and `max_tokens`) from measured peaks of dummy passes (once per name).

    `owner.max_tokens` is the scorer's cap on the tokens of one padded pass, the plan's
    (`default_pass_tokens`) unless the config set it. With `tune` (the cap was not set in the
    config) and on CPU, the cap is tuned first (`tune_pass_tokens`) and set on `owner`, from the
    calibration cache on a warm start; a tuning timed on a busy machine keeps the plan's cap
    (`calibration.CpuShare`). The profiled shapes reach the cap with batches of short inputs: the
    planner admits no shape wider than the widest profiled, so a grid of batches up to 4 held
    every pass of short inputs to 4 rows, and on a small model the per-pass overhead then cost
    2-3x the floor (2026-11-30). `then()` runs once the
    fit is in place (`Profile.then`).
    """
    runtime, model, max_length, pass_tokens = owner.runtime, owner.model, owner.max_length, owner.max_tokens
    if owner.name in runtime.memory.cost_models:
        return  # a checkpoint shared by two scorers is profiled once
    token_id = min(1000, model.config.vocab_size - 1)

    def run(b: int, length: int, padded: bool = True) -> None:
        batch = pad_batch(model, [[token_id] * length] * b, 0, [[0] * length] * b)
        if padded and length > 1:
            # One padded position, as real batches have: the attention mask is then built (sdpa
            # drops an all-ones mask), the path scoring takes; a lone input only costs less.
            batch["attention_mask"][-1, -1] = 0
        head(model(**batch), batch["attention_mask"])

    def apply(settings: dict[str, Any]) -> None:
        if tune and "pass_tokens" in settings:
            owner.max_tokens = int(settings["pass_tokens"])

    def shapes(settings: dict[str, Any]) -> list[tuple[int, int]]:
        return pass_shapes(max_length, int(settings.get("pass_tokens", pass_tokens)))

    tune_cpu = tune and runtime.device.type == "cpu"
    tuner = (lambda: {"pass_tokens": tune_pass_tokens(run, max_length, pass_tokens)}) if tune_cpu else None
    runtime.memory.calibrate(Profile(owner.name, run, max_length=max_length, shapes=shapes, tune=tuner, apply=apply,
                                     lone_run=lambda length: run(1, length, padded=False),  # a batch of one: no mask
                                     planned={"pass_tokens": pass_tokens} if tune_cpu else None, then=then))


def pass_shapes(max_length: int, pass_tokens: int) -> list[tuple[int, int]]:
    """The profile grid: every length alone up to the bound, a few small batches (the fit is
    linear in the batch size), and at each length the widest batch the pass cap allows."""
    lengths = sorted({max(8, max_length // 8), max(16, max_length // 4), max(32, max_length // 2), max_length})
    shapes = {(1, n) for n in lengths} | {(2, lengths[1]), (4, lengths[0]), (2, lengths[2])}
    for n in sorted({max(8, max_length // 32), *lengths}):
        b = min(MAX_PASS_ROWS, pass_tokens // n)
        if b > 1:
            shapes.add((b, min(n, max_length)))
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def tune_pass_tokens(run: Callable[[int, int], Any], max_length: int, plan: int | None = None, *,
                     rounds: int = ROUNDS) -> int:
    """The CPU pass cap (tokens): the plan's (`default_pass_tokens`), halved (at most
    `SHRINK_STEPS` times) only while the larger pass is measurably slower than the smaller one.

    Each comparison runs the same rows (half the bound long, as many as the larger pass holds) in
    passes of either size, `rounds` times in alternating order; the larger is slower when it is
    slower by `SLOWER_BY` in every round and in the best round of each (`_slower`), and only a
    re-check, timed afresh, makes that a halving. So a burst of load during one pass, or a load
    that slows both sizes alike, keeps the plan's size; a pass never drops below a quarter of the
    plan nor below one window (a 64-token model keeps 64 rows a pass: no halving changes that).
    Small models gain from wide passes (per-pass overhead); larger ones may not (activations fall
    out of cache: the MiniLM encoders ran 30-50% slower at 8 windows than at 1-2, 2026-11-30).
    """
    chosen = plan or default_pass_tokens(max_length, torch.device("cpu"))
    width = max(8, max_length // 2)

    def rows(cap: int) -> int:
        return max(1, min(MAX_PASS_ROWS, cap // width))

    with torch.inference_mode():
        run(2, min(width, 16))  # first-call costs out of the timing
        for _ in range(SHRINK_STEPS):
            smaller = chosen // 2
            if smaller < max_length or rows(smaller) == rows(chosen):
                break
            if not all(_slower(run, rows(chosen), rows(smaller), width, rounds) for _ in range(2)):  # and a re-check
                break
            chosen = smaller
    return chosen


def _slower(run: Callable[[int, int], Any], large: int, small: int, width: int, rounds: int) -> bool:
    """Whether `large` rows of `width` tokens in one pass take `SLOWER_BY` longer than the same rows
    in passes of `small` rows: in every one of `rounds` rounds (the two interleaved, in alternating
    order), and best round against best round. The first round that finds it not slower ends the
    timing (the plan's size then stays): a model that gains from wide passes pays one round."""
    slow: list[float] = []
    fast: list[float] = []
    for r in range(rounds):
        for per_pass in (large, small) if r % 2 == 0 else (small, large):
            t = time.perf_counter()
            for k in range(0, large, per_pass):
                run(min(per_pass, large - k), width)
            (slow if per_pass == large else fast).append(time.perf_counter() - t)
        if slow[-1] <= SLOWER_BY * fast[-1]:
            return False
    return min(slow) > SLOWER_BY * min(fast)


def token_groups(order: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Cut length-sorted indices into groups whose padded rectangle stays within `max_tokens`: the
    greedy pass of the planner's groups (`costmodel.greedy_groups`), closed by the rectangle."""
    return greedy_groups(order, lengths, lambda count, longest, _: count * longest > max_tokens)


def rows_pass(
    model: torch.nn.Module,
    rows: Sequence[Sequence[int]],
    head: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    pad_id: int,
    types: Sequence[Sequence[int]] | None = None,
    max_tokens: int,
    max_batch: int | None = None,
    completions: Sequence[int | None] | None = None,
) -> Pass:
    """The `Pass` of token-id rows: a batch's value for row j is `head(model output, attention
    mask)` row j, on CPU. `completions`: the step's completion index of each row (None: the prompt),
    for the telemetry.

    The memory manager plans batches against the budget; inside a planned batch, passes are cut
    so that no pass pads more than `max_tokens` tokens, which keeps the peak of a step with one
    40,000-character input near that of a short one.
    """
    lengths = [len(r) for r in rows]

    def forward(idx: list[int]) -> list[Any]:
        order = sorted(idx, key=lambda i: lengths[i])
        values: dict[int, Any] = {}
        for group in token_groups(order, lengths, max_tokens):
            batch = pad_batch(
                model, [rows[i] for i in group], pad_id, [types[i] for i in group] if types is not None else None
            )
            out = head(model(**batch), batch["attention_mask"]).float().cpu()
            del batch  # free the group's activations before the next group
            values.update(zip(group, out))
        return [values[i] for i in idx]

    return Pass(lengths, forward, max_batch=max_batch, completions=completions)


# -- every family: the length bound and padding ----------------------------------------------------
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


def pad_rows(rows: Sequence[Sequence[int]], pad: int, *, left: bool = False,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids padded to one width (right-padded, or left with `left=True`): (ids, mask), long.

    Built as Python lists and converted by one `torch.tensor` call each: filling a preallocated
    tensor row by row costs about five aten ops a row (select, slice, lift_fresh, copy_, detach_),
    which under the tensor-bytes tracker's per-op accounting was half the ops of a tiny soak step.
    """
    w = max(1, max((len(r) for r in rows), default=0)) if width is None else width
    ids, mask = [], []
    for r in rows:
        r = list(r)
        n = w - len(r)
        if left:
            ids.append([pad] * n + r)
            mask.append([0] * n + [1] * len(r))
        else:
            ids.append(r + [pad] * n)
            mask.append([1] * len(r) + [0] * n)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


# -- the character bound before tokenizing ---------------------------------------------------------
_SAFE_NORMALIZERS = {"BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Strip",
                     "Precompiled", "Prepend", "Replace", "Nmt"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Metaspace", "Digits",
                        "Punctuation"}
_SAFE_MODELS = {"BPE", "WordPiece", "Unigram", "WordLevel"}
_WHITESPACE_ONLY = re.compile(r"(?:\\s|\\n|\\r|\\t| |\{\d*,?\d*\}|[|\[\]+*])+")
"""A Replace regex built only of whitespace classes and repetition: its matches are whitespace."""
CHARS_PER_TOKEN_START = 8
"""First head tried: this many characters per token kept (doubled until the head is long enough)."""


def _parts(node: Any, key: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        out: list[dict] = []
        for child in node.get(key, []):
            out += _parts(child, key)
        return out
    return [node]


def _safe_normalizer(n: dict) -> bool:
    if n.get("type") not in _SAFE_NORMALIZERS:
        return False
    if n["type"] == "Replace":
        pattern = n.get("pattern", {})
        text = pattern.get("String", pattern.get("Regex", ""))
        # Safe when no match can hold whitespace (it never reaches the boundary's space), or every
        # match is whitespace only (DeBERTa-v3's `\s{2,}|[\n\r\t]`: a run at the boundary is
        # after the cut, and the head ends in a non-space).
        return not re.search(r"\s|\\[sntr]", text) or _WHITESPACE_ONLY.fullmatch(text) is not None
    return True


def _safe_pre_tokenizer(p: dict) -> bool:
    if p.get("type") not in _SAFE_PRE_TOKENIZERS:
        return False
    if p["type"] == "ByteLevel":
        return bool(p.get("use_regex", True))  # without its regex the whole text is one piece
    if p["type"] == "Metaspace":
        return bool(p.get("split", True))
    return True


@functools.lru_cache(maxsize=None)  # per tokenizer object: they hash by identity
def prefix_stable(tokenizer: Any) -> bool:
    """Whether a head cut at a safe boundary tokenizes to a prefix of the whole text's tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    added = [str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    if backend is None or any(re.search(r"\s", t) for t in added):
        return False
    doc = json.loads(backend.to_str())
    pres = _parts(doc.get("pre_tokenizer"), "pretokenizers")
    if not pres or not all(_safe_pre_tokenizer(p) for p in pres):
        return False  # no pre-tokenizer: the model sees the whole text as one piece
    if not all(_safe_normalizer(n) for n in _parts(doc.get("normalizer"), "normalizers")):
        return False
    return (doc.get("model") or {}).get("type") in _SAFE_MODELS


def safe_boundary(text: str, limit: int) -> int | None:
    """The last safe boundary at or before `limit` (a U+0020 after a non-space), or None."""
    p = text.rfind(" ", 0, limit + 1)
    while p > 0:
        if not text[p - 1].isspace():
            return p
        p = text.rfind(" ", 0, p)
    return None


def head_for_tokens(text: str, tokenizer: Any, tokens: int) -> str:
    """A prefix of `text` whose tokens are the first tokens of `text`, more than `tokens` of them;
    `text` itself when there is none shorter (or the tokenizer is not prefix-stable)."""
    limit = CHARS_PER_TOKEN_START * (tokens + 1)
    if len(text) <= limit or not prefix_stable(tokenizer):
        return text
    tried = -1
    while limit < len(text):
        p = safe_boundary(text, limit)
        if p is not None and p != tried:
            tried = p
            head = text[:p]
            if len(tokenizer(head, add_special_tokens=False)["input_ids"]) > tokens:
                return head
        limit *= 2
    return text

