"""Cut a text before tokenizing, where the cut provably keeps the tokens a model's bound keeps.

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

import json
import re
from typing import Any

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


_CHECKED: dict[int, tuple[Any, bool]] = {}
"""id(tokenizer) -> (the tokenizer, kept so the id stays its own; whether it is prefix-stable)."""


def prefix_stable(tokenizer: Any) -> bool:
    """Whether a head cut at a safe boundary tokenizes to a prefix of the whole text's tokens."""
    hit = _CHECKED.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    stable = backend is not None and _stable_pipeline(backend.to_str(), tuple(_added_tokens(tokenizer)))
    _CHECKED[id(tokenizer)] = (tokenizer, stable)
    return stable


def _added_tokens(tokenizer: Any) -> list[str]:
    try:
        return [t.content if hasattr(t, "content") else str(t) for t in tokenizer.added_tokens_decoder.values()]
    except AttributeError:
        return []


def _stable_pipeline(spec: str, added: tuple[str, ...]) -> bool:
    doc = json.loads(spec)
    if any(re.search(r"\s", t) for t in added):
        return False
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


__all__ = ["CHARS_PER_TOKEN_START", "head_for_tokens", "prefix_stable", "safe_boundary"]
