"""Stand-in of the Reciprocate family (`scorers/reciprocate.py`): a tiny random GPT-J sequence classifier."""

from __future__ import annotations

from pathlib import Path

import torch

from rewardstack._standins.tokenizer import BERT_INPUTS, save_tokenizer


def make_standin(folder: Path) -> dict:
    """A tiny random GPTJForSequenceClassification (one label, pad token set) + BERT tokenizer."""
    from transformers import GPTJConfig, GPTJForSequenceClassification

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # With token_type_ids, unlike GPT-J's own tokenizer: the reference passes them to the model,
    # and so must the scorer (tests/test_reciprocate.py fails if it drops them).
    tok = save_tokenizer(folder, 512, input_names=BERT_INPUTS)
    config = GPTJConfig(
        vocab_size=len(tok), n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
        num_labels=1, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id, initializer_range=0.2,
    )
    torch.manual_seed(4321)
    GPTJForSequenceClassification(config).save_pretrained(str(folder), safe_serialization=True)
    return {"path": folder.name, "dtype": "float32"}
