"""Modeling code of the BTLM-like stand-in, written the way 2023 hub remote code was (transformers 4.x).

Like cerebras/btlm-3b-8k-base's own `modeling_btlm.py`: a GPT-2 layout without learned positions,
ALiBi attention biases, SwiGLU MLPs, muP scales (embeddings multiplied by `mup_embeddings_scale`,
attention scaled by 1/d when `mup_scale_qk_dot_by_d`, logits multiplied by
`output_logits_scale = mup_output_alpha * mup_width_scale` outside the head), and the 4.x cache
convention: `past_key_values` is a tuple of per-layer (key, value) tuples and `presents` is
returned the same way. It knows nothing of transformers' cache objects, which is what makes the
scorers' load-time probe send it to the full-sequence path. It holds only what loading and a forward
pass run: no dropout (the stand-in never trains) and no device-map hints.

This file is copied into a checkpoint folder next to `config.json` (whose `auto_map` names it) and
loaded with `trust_remote_code=True`, exactly as the hub model is.
"""

import math

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.modeling_utils import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .configuration_btlm import BTLMConfig


def _alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes for a power-of-two head count (every stand-in's; the slopes
    are saved with the weights, so what a checkpoint runs is what it holds)."""
    start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
    return torch.tensor([start * start**i for i in range(n_heads)])


class AlibiPositionEmbeddingLayer(nn.Module):
    """Per-head linear biases -slope * |query position - key position|.

    As in the hub code, the slopes are a frozen parameter `[heads, 1]` saved with the weights (so
    they take the model's dtype, and the bias is formed in it). A non-persistent buffer would not
    survive transformers 5's loading, which builds models on the meta device and fills only what
    the checkpoint holds.
    """

    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.slopes = nn.parameter.Parameter(_alibi_slopes(num_heads).unsqueeze(-1), requires_grad=False)

    def forward(self, seq_length, key_length):
        context_position = torch.arange(key_length - seq_length, key_length, device=self.slopes.device)[:, None]
        memory_position = torch.arange(key_length, device=self.slopes.device)[None, :]
        relative_position = torch.abs(memory_position - context_position).unsqueeze(0).expand(self.num_heads, -1, -1)
        return (self.slopes * -1.0).unsqueeze(1) * relative_position  # [heads, q, k]


class BTLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.scale_attn_weights = config.scale_attn_weights
        self.attn_scale_power = 1.0 if config.mup_scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _split_heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, position_bias=None, use_cache=False):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None

        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype, device=attn_weights.device
            )
        q_len, k_len = query.size(-2), key.size(-2)
        causal = torch.ones((q_len, k_len), dtype=torch.bool, device=query.device).tril(k_len - q_len)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal, attn_weights, mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        if position_bias is not None:
            attn_weights = attn_weights + position_bias.unsqueeze(0).to(attn_weights.dtype)
        attn_weights = nn.functional.softmax(attn_weights.float(), dim=-1).type(value.dtype)
        attn_output = torch.matmul(attn_weights, value)
        b = attn_output.size(0)
        attn_output = attn_output.permute(0, 2, 1, 3).reshape(b, q_len, self.embed_dim)
        attn_output = self.c_proj(attn_output)
        return attn_output, present


class BTLMMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_fc2 = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)

    def forward(self, hidden_states):
        return self.c_proj(self.c_fc(hidden_states) * nn.functional.silu(self.c_fc2(hidden_states)))


class BTLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = BTLMAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = BTLMMLP(inner, config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, position_bias=None, use_cache=False):
        attn_output, present = self.attn(
            self.ln_1(hidden_states), layer_past=layer_past, attention_mask=attention_mask,
            position_bias=position_bias, use_cache=use_cache,
        )
        hidden_states = attn_output + hidden_states
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return hidden_states, present


class BTLMPreTrainedModel(PreTrainedModel):
    config_class = BTLMConfig
    base_model_prefix = "transformer"

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, Conv1D)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)


class BTLMModel(BTLMPreTrainedModel):
    _input_embed_layer = "wte"  # transformers' own get_input_embeddings (and the head's) read it

    def __init__(self, config):
        super().__init__(config)
        self.embed_dim = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.h = nn.ModuleList([BTLMBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.relative_pe = AlibiPositionEmbeddingLayer(config.n_head)
        self.embeddings_scale = config.mup_embeddings_scale
        self.post_init()

    def forward(self, input_ids, past_key_values=None, attention_mask=None, token_type_ids=None, position_ids=None,
                use_cache=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        inputs_embeds = self.wte(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        # position_ids are accepted for the GPT-2 signature; ALiBi needs no learned positions.
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :].to(dtype=inputs_embeds.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(inputs_embeds.dtype).min
        hidden_states = inputs_embeds
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids)
        hidden_states = hidden_states * self.embeddings_scale
        position_bias = self.relative_pe(seq_len, past_length + seq_len)

        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                position_bias=position_bias, use_cache=use_cache,
            )
            if use_cache:
                presents = presents + (present,)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.ln_f(hidden_states),
                                                         past_key_values=presents)


class BTLMLMHeadModel(BTLMPreTrainedModel):
    # The one change from 4.x conventions: transformers 5 reads this as {tied: source}; the 4.x
    # list form (["lm_head.weight"]) fails in `post_init` there.
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.transformer = BTLMModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.output_logits_scale = config.mup_output_alpha * config.mup_width_scale
        self.post_init()

    # Defined as the hub code defines it (generation is never run): transformers warns that a class
    # defining it without GenerationMixin cannot generate, the warning `rewardstack._quiet` silences.
    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids, **kwargs}

    def forward(self, input_ids, past_key_values=None, attention_mask=None, token_type_ids=None, position_ids=None,
                use_cache=None):
        transformer_outputs = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids, use_cache=use_cache,
        )
        lm_logits = self.lm_head(transformer_outputs[0])
        lm_logits *= torch.tensor(float(self.output_logits_scale), dtype=lm_logits.dtype, device=lm_logits.device)
        return CausalLMOutputWithCrossAttentions(logits=lm_logits, past_key_values=transformer_outputs.past_key_values)
