"""Tiny HuggingFace sequence-classification reward models for the trainer-route tests.

Built from a config (no hub, no network) and saved with `save_pretrained`, as a user's reward
model folder would be: a Llama (last-token head) with a chat template on its tokenizer, the shape of
the reward models OpenRLHF and verl train, over the small byte-level BPE tokenizer of
tests/small_models.py. Its tokenizer has Llama-3's BOS convention: the post-processor adds
`BOS` to a text tokenized with special tokens, and the chat template writes it, so a rendered chat
tokenized with special tokens carries two (the case OpenRLHF's and verl's conventions are about).
`reference_scores` is that model's own transformers forward, one text at a time, unpadded: what
every route must answer within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from small_models import save_small_tokenizer

BOS = "<|begin_of_text|>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
"""A chat template the small tokenizer can render: the BOS first, as Llama-3's writes it, then
`<|endoftext|>` opening each turn."""


def make_tiny_llama_rm(folder: Path, max_length: int = 256, seed: int = 11, *,
                       chat_template: str = CHAT_TEMPLATE) -> Path:
    """A tiny LlamaForSequenceClassification (num_labels=1) with a chat template, saved in `folder`."""
    from tokenizers import processors
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    save_small_tokenizer(folder, max_length, token_types=False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"bos_token": BOS})
    # Llama-3's tokenizer.json: a post-processor that puts the BOS before every text.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.bos_token_id)])
    tok.chat_template = chat_template
    tok.save_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_length,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         num_labels=1, initializer_range=0.2)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def reference_scores(folder: Path, texts: list[str], *, add_special_tokens: bool = True,
                     max_length: int | None = None, side: str = "right") -> list[float]:
    """The model's own transformers forward on each text alone (no padding): its first logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.truncation_side = side
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            enc = tok(t, return_tensors="pt", add_special_tokens=add_special_tokens,
                      truncation=max_length is not None, max_length=max_length)
            out.append(float(model(**enc).logits[0, 0]))
    return out


def rewards_config(folder: Path, model: Path, *, extra: str = "", name: str = "tiny") -> Path:
    """A config serving only the user-named reward model `name` from `model` (a local folder)."""
    state = folder / "state"
    path = folder / "rewards.toml"
    path.write_text(f'device = "cpu"\nstate_dir = "{state}"\n\n[rewards.{name}]\npath = "{model}"\n{extra}\n',
                    encoding="utf-8")
    return path


def texts(n: int, seed: int = 0, answer_words: int = 40) -> list[str]:
    """`n` chat-rendered prompt+response texts of varied lengths, the BOS written in (what the chat
    template renders, and what OpenRLHF sends), answers of 1 to `answer_words` words."""
    import random

    from small_models import _corpus

    rng = random.Random(seed)
    words = " ".join(_corpus()).split()
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        a = " ".join(rng.choice(words) for _ in range(rng.randint(1, answer_words)))
        out.append(f"{BOS}<|endoftext|>user: {q}\n<|endoftext|>assistant: {a}\n")
    return out


def any_value(x: Any) -> Any:  # pragma: no cover - a helper for readable assertion messages
    return x
