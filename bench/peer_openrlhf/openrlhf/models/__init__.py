# REPLACES https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
# file openrlhf/models/__init__.py (git blob 5223f26ae0f177fb2f05c4350002697c946caaf4), whose
# `get_llm_for_sequence_regression` (openrlhf/models/model.py) needs deepspeed, peft and, by default,
# flash-attention and bfloat16. This is the one part of the peer that is not OpenRLHF's code.
# The diff: bench/peer_openrlhf/CHANGES.diff.
# ---
"""OpenRLHF's reward-model loader, replaced: the same folder through transformers, in float32.

`get_llm_for_sequence_regression(path, "reward", ...)` loads `path` with
`AutoModelForSequenceClassification` in float32 with SDPA attention (serve_rm.py's `param_dtype`,
bf16 by default, and its `attn_implementation`, flash_attention_2 by default, are accepted and not
used: the benchmark runs on CPU in float32) and wraps it in the forward of OpenRLHF's `RewardModel`
(openrlhf/models/model.py `_get_reward_model`, its non-packing path): position ids from the attention
mask's cumulative sum, the body, the `score` head on every position, and the value at the last
attended token (the "eos index" taken from the mask, so left padding is handled as OpenRLHF does).
The result is the model's first logit per row. The model stays on the CPU whatever `device_map`
says (the benchmark's other contestants run there); `normalize_reward` divides by the config's
`mean`/`std` as OpenRLHF does.
"""

import torch
import torch.nn as nn
from transformers import AutoModelForSequenceClassification

from openrlhf.utils.logging_utils import init_logger

logger = init_logger(__name__)


class RewardHead(nn.Module):
    """A sequence-classification model behind OpenRLHF's `RewardModel.forward`."""

    def __init__(self, model: nn.Module, normalize_reward: bool = False) -> None:
        super().__init__()
        self.model = model
        self.normalize_reward = normalize_reward
        self.register_buffer("mean", torch.tensor([float(getattr(model.config, "mean", 0.0))]), persistent=False)
        self.register_buffer("std", torch.tensor([float(getattr(model.config, "std", 1.0))]), persistent=False)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> torch.Tensor:
        eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        body = getattr(self.model, self.model.base_model_prefix)
        outputs = body(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        values = self.model.score(outputs["last_hidden_state"])[..., 0]  # the first logit at every position
        reward = values.gather(dim=1, index=eos_indices).squeeze(1)
        if not self.training and self.normalize_reward:
            reward = (reward - self.mean) / self.std
        return reward


def get_llm_for_sequence_regression(model_name_or_path, model_type, *, normalize_reward=False, **ignored) -> nn.Module:
    assert model_type == "reward", f"this loader serves reward models only, not {model_type!r}"
    model = AutoModelForSequenceClassification.from_pretrained(
        model_name_or_path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    logger.info(f"loaded {type(model).__name__} in float32 (sdpa), {torch.get_num_threads()} torch threads; "
                f"not used: {sorted(ignored)}")
    return RewardHead(model, normalize_reward)
