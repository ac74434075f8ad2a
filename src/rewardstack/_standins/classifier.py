"""Stand-ins of the classifier family: tiny random DeBERTa-v3 and RoBERTa classifiers (`scorers/classifier.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rewardstack._standins.tokenizer import save_tokenizer


def make_openassistant_standin(folder: Path) -> dict[str, Any]:
    """A tiny random DeBERTa-v3-shaped reward model (relative attention, 1 label) in `folder`."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = DebertaV2Config(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=512, relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, type_vocab_size=0, num_labels=1, pad_token_id=0, initializer_range=0.1,
    )
    model = DebertaV2ForSequenceClassification(config)
    with torch.no_grad():  # spread the random logits (about -0.7..1.2) so parity tests are meaningful
        model.classifier.weight.mul_(5.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    # DeBERTa-v3's tokenizer reports ~1e30: the bound must not come from it.
    save_tokenizer(folder, model_max_length=1e30)
    return {"path": folder.name, "dtype": "float32"}


def make_nsfw_standin(folder: Path) -> dict[str, Any]:
    """A tiny random RoBERTa hate-speech classifier (2 labels) in `folder`."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    config = RobertaConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=514, type_vocab_size=1, num_labels=2, pad_token_id=0, bos_token_id=101,
        eos_token_id=102, initializer_range=0.1,
    )
    model = RobertaForSequenceClassification(config)
    with torch.no_grad():  # spread the window values around the -0.5 threshold so both outcomes occur
        model.classifier.out_proj.weight.mul_(5.0)
        model.classifier.out_proj.bias.copy_(torch.tensor([3.0, -0.94]))  # hate values centred on -0.5
    model.save_pretrained(str(folder), safe_serialization=True)
    save_tokenizer(folder)
    return {"path": folder.name, "dtype": "float32"}
