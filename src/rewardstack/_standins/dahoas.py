"""Stand-in of the Dahoas family (`scorers/dahoas.py`): a tiny random GPT-J body and its value head."""

from __future__ import annotations

from pathlib import Path

import torch

from rewardstack._standins.tokenizer import DECODER_INPUTS, save_tokenizer


def make_standin(folder: Path) -> dict:
    """A tiny random GPT-J body (save_pretrained) + `v_head.safetensors`, BERT tokenizer with eos.

    The tokenizer gets `<|endoftext|>` as its eos token, as GPT-J's has, so the first-pad rule reads
    the value before it.
    """
    from safetensors.torch import save_file
    from transformers import GPTJConfig, GPTJModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(folder, 2048, input_names=DECODER_INPUTS, eos_token="<|endoftext|>")
    config = GPTJConfig(
        vocab_size=len(tok), n_positions=2048, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.2,
    )
    torch.manual_seed(2468)
    GPTJModel(config).save_pretrained(str(folder), safe_serialization=True)
    save_file({"v_head.weight": torch.randn(1, config.n_embd) * 0.2}, str(folder / "v_head.safetensors"))
    return {"path": folder.name, "dtype": "float32"}
