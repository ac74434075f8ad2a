"""Small-vocabulary checkpoints for the extreme-input parity tests (repetition, longest length).

The packaged stand-ins use the real 30,522-token BERT vocabulary, which makes a literal reference
(full [L, V] logits, a Python loop per position) at 8,192 tokens slow. These helpers build a
byte-level BPE tokenizer of a few hundred tokens, trained offline on the workload's words, and
tiny decoders over it. The tokenizer returns `token_type_ids` (as BERT-style tokenizers do), so a
scorer that drops or adds them where the reference does not is caught by a parity test: GPT-2 and
GPT-J add the embedding of the token type to every position when they are given them. Byte-level
BPE decodes back to the exact text, which the judge's reference relies on (it cuts the decoded
output at the prompt's character length).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.soak.synthetic import _WORDS

SPECIALS = ["<|endoftext|>", "<pad>"]


def _corpus() -> list[str]:
    words = list(_WORDS) + ["Here", "is", "a", "text", "summary", "question", "Score", "Rate", "it", "from",
                            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "<Score>", "</Score>"]
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines * 4 + ["".join(chr(c) for c in range(32, 127))]


def save_small_tokenizer(folder: Path, model_max_length: int, *, token_types: bool = True,
                         padding_side: str = "right") -> Any:
    """A ~400-token byte-level BPE tokenizer saved in `folder`; returns it reloaded from there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_corpus(), trainer=trainer)
    # Type ids 0 for a single text, 1 for a pair's second text (BERT's convention).
    tk.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<pad>", model_max_length=model_max_length,
        model_input_names=names, padding_side=padding_side,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def make_small_gpt2(folder: Path, max_length: int = 8192, seed: int = 7) -> Any:
    """A tiny GPT-2 LM (BTLM's family) over the small tokenizer; returns the tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = save_small_tokenizer(folder, max_length)
    # Logits of a few units, like a real LM's: the float16 penalty then
    # saturates within ~50 repetitions, as it does on the real model.
    config = GPT2Config(vocab_size=len(tok), n_positions=max_length, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=1.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(str(folder), safe_serialization=True)
    return tok


def make_small_gptj_classifier(folder: Path, max_length: int = 2048, seed: int = 8) -> Any:
    """A tiny GPT-J sequence classifier (Reciprocate's family) over the small tokenizer."""
    from transformers import GPTJConfig, GPTJForSequenceClassification

    tok = save_small_tokenizer(folder, max_length)
    config = GPTJConfig(vocab_size=len(tok), n_positions=max_length, n_embd=32, n_layer=2, n_head=2, rotary_dim=8,
                        num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, initializer_range=0.3)
    torch.manual_seed(seed)
    GPTJForSequenceClassification(config).save_pretrained(str(folder), safe_serialization=True)
    return tok


def make_small_llama(folder: Path, max_length: int = 2048, seed: int = 9) -> Any:
    """A tiny Llama LM (the judge's family) over the small tokenizer, padding on the left."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = save_small_tokenizer(folder, max_length, token_types=False, padding_side="left")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_length,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         initializer_range=0.3)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return tok
