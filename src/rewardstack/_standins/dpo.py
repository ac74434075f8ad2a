"""Stand-ins of the DPO family (`scorers/dpo.py`): a tiny GPT-2-style LM, or the BTLM-like remote-code checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from rewardstack._standins.tokenizer import DECODER_INPUTS, save_tokenizer


def make_standin(folder: Path, *, max_length: int = 8192, config_overrides: dict | None = None) -> dict:
    """A tiny random GPT-2-style LM (BTLM is GPT-2 based) with the real BERT tokenizer, 8k context.

    `config_overrides` replaces GPT2Config fields (e.g. n_embd, n_layer, n_head for a stand-in
    whose body outweighs its head, as BTLM's does); the default is the tiny CI model.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(folder, max_length, input_names=DECODER_INPUTS)
    fields: dict = dict(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
    )
    fields.update(config_overrides or {})
    config = GPT2Config(**fields)
    torch.manual_seed(1234)
    GPT2LMHeadModel(config).save_pretrained(str(folder), safe_serialization=True)
    return {"path": folder.name, "dtype": "float32"}


def make_btlm_checkpoint(folder: str | Path, *, max_length: int = 8192, seed: int = 1234,
                         config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random BTLM-like checkpoint (remote code + weights + BERT tokenizer) to `folder`.

    The layout of cerebras/btlm-3b-8k-base on the hub: `config.json` with `model_type = "btlm"`
    and an `auto_map`, the code files of `rewardstack._standin_btlm` beside it, so the folder loads
    only with `trust_remote_code=True`, through the same `from_pretrained` call the hub model takes.
    Defaults: 2 layers, width 64, 4 heads, SwiGLU inner 128, muP output scale 0.5 and embedding
    scale 2 (so a scorer that dropped either would disagree with the reference), `max_length`
    positions (ALiBi has no learned positions; the bound is the config's and the tokenizer's).
    """
    from rewardstack import _standin_btlm as standin_btlm
    from rewardstack._standin_btlm import AUTO_MAP, CODE_FILES
    from rewardstack._standin_btlm.configuration_btlm import BTLMConfig
    from rewardstack._standin_btlm.modeling_btlm import BTLMLMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(folder, max_length, input_names=DECODER_INPUTS)
    fields: dict[str, Any] = dict(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, n_inner=128,
        initializer_range=0.2, mup_width_scale=0.25, mup_output_alpha=2.0, mup_embeddings_scale=2.0,
        mup_scale_qk_dot_by_d=True, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    fields.update(config_overrides or {})
    config = BTLMConfig(**fields)
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["BTLMLMHeadModel"]
    torch.manual_seed(seed)
    model = BTLMLMHeadModel(config)
    model.save_pretrained(str(folder), safe_serialization=True)
    here = Path(standin_btlm.__file__).parent
    for name in CODE_FILES:
        shutil.copyfile(here / name, folder / name)
    # save_pretrained of a class imported from a package does not record remote code: make sure
    # config.json carries the auto_map the hub checkpoint has.
    conf_file = folder / "config.json"
    conf = json.loads(conf_file.read_text(encoding="utf-8"))
    conf["auto_map"] = dict(AUTO_MAP)
    conf["model_type"] = "btlm"
    conf_file.write_text(json.dumps(conf, indent=2), encoding="utf-8")
    return folder


def make_btlm_standin(folder: Path, *, max_length: int = 8192) -> dict[str, Any]:
    """The DPO stand-in of `rewardstack make-standins --dpo btlm`: that checkpoint, with its config entry.

    The entry opts into remote code, which a local folder the operator built is allowed to run.
    """
    make_btlm_checkpoint(folder, max_length=max_length)
    return {"path": Path(folder).name, "dtype": "float32", "trust_remote_code": True}
