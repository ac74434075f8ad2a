"""Stand-in of the judge family (`scorers/judge.py`): a tiny random Llama-style causal LM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rewardstack._standins.tokenizer import DECODER_INPUTS, save_tokenizer


def make_standin(folder: Path) -> dict[str, Any]:
    """A tiny random Llama-style causal LM with the real BERT tokenizer (512 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(folder, 512, input_names=DECODER_INPUTS)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.2,
    )
    torch.manual_seed(1357)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return {"path": folder.name, "dtype": "float32"}
