"""A BTLM-like checkpoint that loads through remote code, for tests, the stand-in stack and benchmarks.

`make_checkpoint(folder)` writes a tiny random checkpoint in the layout of cerebras/btlm-3b-8k-base
on the hub: `config.json` with `model_type = "btlm"` and an `auto_map` naming
`configuration_btlm.BTLMConfig` / `modeling_btlm.BTLMLMHeadModel`, those two files beside it
(copied from this package), safetensors weights and a tokenizer. transformers has no `btlm`
architecture, so the folder loads only with `trust_remote_code=True`, through
`AutoModelForCausalLM.from_pretrained(folder)`, the same call the hub model takes.

The modeling code keeps the 4.x conventions of 2023 remote code (tuple `past_key_values`, no cache
objects), ALiBi, SwiGLU and the muP output scale, so the scorers' cache probe, the full-sequence
fallback and the logits scale are all exercised by it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

CODE_FILES = ("configuration_btlm.py", "modeling_btlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_btlm.BTLMConfig",
    "AutoModel": "modeling_btlm.BTLMModel",
    "AutoModelForCausalLM": "modeling_btlm.BTLMLMHeadModel",
}


def make_checkpoint(folder: str | Path, *, max_length: int = 8192, seed: int = 1234,
                    config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random BTLM-like checkpoint (remote code + weights + BERT tokenizer) to `folder`.

    Defaults: 2 layers, width 64, 4 heads, SwiGLU inner 128, muP output scale 0.5 and embedding
    scale 2 (so a scorer that dropped either would disagree with the reference), `max_length`
    positions (ALiBi has no learned positions; the bound is the config's and the tokenizer's).
    """
    from rewardstack.scorers.prefix import save_standin_tokenizer
    from rewardstack.standin_btlm.configuration_btlm import BTLMConfig
    from rewardstack.standin_btlm.modeling_btlm import BTLMLMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_standin_tokenizer(folder, max_length)
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
    here = Path(__file__).parent
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


def make_dpo_standin(folder: Path, *, max_length: int = 8192) -> dict[str, Any]:
    """The DPO stand-in of `rewardstack make-standins --dpo btlm`: this checkpoint, with its config entry.

    The entry opts into remote code, which a local folder the operator built is allowed to run.
    """
    make_checkpoint(folder, max_length=max_length)
    return {"path": Path(folder).name, "dtype": "float32", "trust_remote_code": True}
