"""Every tokenizer kind the default stack uses loads offline, from a small vocabulary built here.

The default stack's checkpoints bring: a DeBERTa-v3 sentencepiece model (OpenAssistant; needs
`sentencepiece` and `protobuf`, dependencies of the package), GPT-2 byte-level BPE (GPT-J for
Reciprocate and Dahoas, BTLM for DPO), a LLaMA sentencepiece model (open-llama, the judge), BERT
WordPiece (relevance model 1), MPNet WordPiece (relevance model 2, diversity) and RoBERTa BPE (the
NSFW filter). Each is built from a tiny vocabulary in a temporary folder and loaded the way the
scorers load it, `AutoTokenizer.from_pretrained(folder)`, with the hub switched off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A judge rates answers from 0 to 10.\n"
    "Summarize the text. What is the question? Here is an answer to it.\n"
    "Reward models score completions; the validator combines them. Rate it: 7 of 10.\n"
) * 20
TEXT = "The lazy fox rates the answer: 7 of 10. Why?"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _train_spm(folder: Path, model_type: str, vocab_size: int = 120, **extra: object) -> "spm.SentencePieceProcessor":
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "spm"), vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, minloglevel=2, hard_vocab_limit=False, **extra,
    )
    (folder / "corpus.txt").unlink()
    return spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))


def _write(folder: Path, name: str, data: object) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (folder / name).write_text(text, encoding="utf-8")


def _load(folder: Path):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def test_deberta_v3_sentencepiece(tmp_path: Path) -> None:
    """OpenAssistant's DeBERTa-v3: spm.model -> [CLS] pieces [SEP], the pieces sentencepiece's own."""
    sp = _train_spm(tmp_path, "unigram", user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
                    pad_id=0, unk_id=3, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]")
    _write(tmp_path, "tokenizer_config.json", {
        "tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False, "bos_token": "[CLS]",
        "eos_token": "[SEP]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
        "pad_token": "[PAD]", "mask_token": "[MASK]", "split_by_punct": False, "vocab_type": "spm",
    })
    tok = _load(tmp_path)
    assert type(tok).__name__ == "DebertaV2Tokenizer"
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert ids[1:-1] == sp.encode(TEXT)
    assert tok.decode(ids, skip_special_tokens=True) == TEXT


def test_llama_sentencepiece(tmp_path: Path) -> None:
    """open-llama's LLaMA tokenizer: <s> + sentencepiece's own ids, byte fallback for the unseen.

    transformers 5 has no slow tokenizer (`use_fast` is ignored): the model card's advice to use
    the slow one cannot be followed, so this checks the converted tokenizer against sentencepiece
    itself on a LLaMA-style model (identity normalization, runs of spaces kept, byte fallback).
    """
    sp = _train_spm(tmp_path, "bpe", byte_fallback=True, normalization_rule_name="identity",
                    remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
                    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, vocab_size=400)
    (tmp_path / "spm.model").rename(tmp_path / "tokenizer.model")
    _write(tmp_path, "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
    })
    tok = _load(tmp_path)
    assert type(tok).__name__ == "LlamaTokenizer"
    for text in (TEXT, "Rate it  from 0 to 10.", "caf\u00e9 \u6f22\u5b57 <Score>8</Score>"):
        assert tok(text).input_ids == [1] + sp.encode(text), text


def _byte_level_bpe(folder: Path, specials: list[str]) -> None:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([CORPUS], vocab_size=400, min_frequency=1, special_tokens=specials)
    bpe.save_model(str(folder))  # vocab.json + merges.txt, the files the hub repositories carry


def test_gpt2_byte_level_bpe(tmp_path: Path) -> None:
    """GPT-J's and BTLM's GPT-2 BPE: no special tokens added, any text round-trips (bytes)."""
    _byte_level_bpe(tmp_path, ["<|endoftext|>"])
    _write(tmp_path, "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "model_max_length": 2048,
    })
    tok = _load(tmp_path)
    assert type(tok).__name__ == "GPT2Tokenizer"
    text = TEXT + " \u00fcber \U0001f642<|endoftext|>"
    ids = tok(text).input_ids
    assert ids[-1] == tok.eos_token_id  # the special token is matched whole, as Dahoas needs
    assert tok.decode(ids) == text


def test_roberta_bpe(tmp_path: Path) -> None:
    """The NSFW filter's RoBERTa BPE: <s> ... </s> around byte-level pieces."""
    _byte_level_bpe(tmp_path, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    _write(tmp_path, "tokenizer_config.json", {"tokenizer_class": "RobertaTokenizer", "model_max_length": 512})
    tok = _load(tmp_path)
    assert type(tok).__name__ == "RobertaTokenizer"
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == TEXT


WORDS = ["the", "quick", "brown", "fox", "lazy", "dog", "judge", "rates", "answer", "of", "why",
         "10", "7", ".", ":", "?", "##s", "##er", "an"]


def test_bert_wordpiece(tmp_path: Path) -> None:
    """Relevance model 1 (bert-base-uncased): lower-cased WordPiece, [CLS] ... [SEP]."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    _write(tmp_path, "vocab.txt", "\n".join(vocab) + "\n")
    _write(tmp_path, "tokenizer_config.json", {"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    tok = _load(tmp_path)
    assert type(tok).__name__ == "BertTokenizer"
    ids = tok("The lazy fox rates the answers").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "the", "lazy", "fox", "rates", "the", "answer", "##s", "[SEP]"]


def test_mpnet_wordpiece(tmp_path: Path) -> None:
    """Relevance model 2 and diversity (all-mpnet-base-v2): WordPiece between <s> and </s>."""
    vocab = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]", "<mask>"] + WORDS
    _write(tmp_path, "vocab.txt", "\n".join(vocab) + "\n")
    _write(tmp_path, "tokenizer_config.json", {"tokenizer_class": "MPNetTokenizer", "do_lower_case": True})
    tok = _load(tmp_path)
    assert type(tok).__name__ == "MPNetTokenizer"
    ids = tok("The quick brown dog").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "the", "quick", "brown", "dog", "</s>"]
