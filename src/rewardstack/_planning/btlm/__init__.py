"""The code of a BTLM-like checkpoint that loads through remote code: `plan`'s model of the default DPO.

`rewardstack plan` simulates the default DPO model (cerebras/btlm-3b-8k-base, hub remote code) by
running this code at full size on the meta device (`configs/archs/btlm-3b-8k.json` names this package
as its `remote_code`); the stand-ins, tests and benchmarks build small checkpoints from it.
`rewardstack._standins.families.make_btlm_checkpoint(folder)` writes a tiny random checkpoint in the
layout of cerebras/btlm-3b-8k-base on the hub: `config.json` with `model_type = "btlm"` and the
`auto_map` below naming `configuration_btlm.BTLMConfig` / `modeling_btlm.BTLMLMHeadModel`, those
two files beside it (`CODE_FILES`, copied from this package), safetensors weights and a tokenizer.
transformers has no `btlm` architecture, so the folder loads only with `trust_remote_code=True`,
through `AutoModelForCausalLM.from_pretrained(folder)`, the same call the hub model takes.

The modeling code keeps the 4.x conventions of 2023 remote code (tuple `past_key_values`, no cache
objects), ALiBi, SwiGLU and the muP output scale, so the scorers' cache probe, the full-sequence
fallback and the logits scale are all exercised by it.
"""

from __future__ import annotations

CODE_FILES = ("configuration_btlm.py", "modeling_btlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_btlm.BTLMConfig",
    "AutoModel": "modeling_btlm.BTLMModel",
    "AutoModelForCausalLM": "modeling_btlm.BTLMLMHeadModel",
}

