"""Configuration of the BTLM-like stand-in (shipped as remote code inside its checkpoint folder).

Field names follow cerebras/btlm-3b-8k-base's `BTLMConfig` (GPT-2 fields plus ALiBi and muP), so
the stand-in exercises the same attributes the scorers read (`n_positions`, `vocab_size`, the muP
output scale). This file is copied into the checkpoint folder and loaded with trust_remote_code.
"""

from transformers.configuration_utils import PretrainedConfig


class BTLMConfig(PretrainedConfig):
    """GPT-2 shaped config with ALiBi positions, SwiGLU MLPs and muP scales (transformers 4.x style)."""

    model_type = "btlm"
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    def __init__(self, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                 initializer_range=0.02, scale_attn_weights=True, use_cache=True, bos_token_id=50256,
                 eos_token_id=50256, position_embedding_type="alibi", mup_width_scale=1.0, mup_embeddings_scale=1.0,
                 mup_output_alpha=1.0, mup_scale_qk_dot_by_d=False, **kwargs):
        fields = dict(locals())
        for name in ("self", "kwargs", "__class__"):
            fields.pop(name, None)
        for name, value in fields.items():  # every field under its own name, as the hub file assigns them
            setattr(self, name, value)
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
