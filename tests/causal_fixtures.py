"""Shared helpers for the decoder-scorer tests: runtimes, configs and literal reference scorers.

The reference functions here are written to read like the spec (and like openvalidators 1.2.0):
one completion at a time, full logits, Python loops. The scorers are checked against them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager
from rewardstack._memory.calibration import CalibrationCache
from rewardstack._scorers.base import Runtime
from rewardstack._scorers.loading import ModelCache


def make_runtime(budget: int | None = None) -> Runtime:
    """A CPU runtime with an optional simulated activation budget."""
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(budget), models=ModelCache(cpu))


_SESSION_CALIBRATION = CalibrationCache(None)  # in memory, one per test process (xdist: per worker)


def cached_runtime(cfg: ModelConfig, budget: int | None = None) -> Runtime:
    """`make_runtime`, with the test session's calibration cache: a scorer built again from the same
    checkpoint and settings reads the fit (and tuned chunk) its first build measured instead of
    profiling again, as a restart does. For tests that do not test calibration; a test of the
    profile itself (a fit, a tune, a profile inside a step) uses `make_runtime`."""
    rt = make_runtime(budget)
    rt.memory.calibration = _SESSION_CALIBRATION
    rt.memory.describe_model(cfg)
    return rt


def model_config(name: str, folder: Path, entry: dict[str, Any], **extra: Any) -> ModelConfig:
    """The ModelConfig a stand-in's entry describes (paths resolved against the folder's parent)."""
    path = str(folder.parent / entry["path"])
    return ModelConfig(name=name, path=path, weight=1.0, dtype=entry.get("dtype", "float32"), **extra)


def reference_dpo(model: Any, tokenizer: Any, prompt: str, completion: str, penalty: float = 1.2,
                  device: str = "cpu") -> float:
    """openvalidators 1.2.0 `DirectPreferenceRewardModel.reward_single`, line for line (`penalty`:
    its 1.2, a parameter so a test can switch the penalty off).

    The model is called on the ids alone (no attention mask, no token types), as the reference does.
    """

    def logit_penalty(input_ids: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
        uniques, counts = input_ids.unique(return_counts=True)
        score = torch.gather(logit, 1, uniques.unsqueeze(0))
        score = torch.where(score < 0, score * (penalty**counts), score / (penalty**counts))
        logit.scatter_(1, uniques.unsqueeze(0), score.to(logit.dtype))
        return logit

    with torch.no_grad():
        if completion.strip() == "" or len(completion) <= 5:
            return -11
        combined = tokenizer(prompt + completion, return_tensors="pt").input_ids[0].to(device)
        prompt_part = tokenizer(prompt, return_tensors="pt").input_ids[0].to(device)
        if tokenizer.model_max_length <= len(prompt_part):
            return -11.0
        if tokenizer.model_max_length < len(combined):
            combined = combined[: tokenizer.model_max_length]
        labels = combined.clone()
        labels[: len(prompt_part)] = -100
        labels = labels[1:]
        loss_mask = labels != -100
        labels[labels == -100] = 0
        labels = labels.unsqueeze(0).unsqueeze(2)
        logits = model(combined.unsqueeze(0)).logits
        logits = logits[:, :-1, :]
        for i in range(len(prompt_part) + 1, len(combined) - 1):
            logit = logits[:, i, :].clone()
            inputs = combined[len(prompt_part) : i].clone()
            logits[:, i, :] = logit_penalty(input_ids=inputs, logit=logit)
        logits = logits.log_softmax(-1)
        per_token_logps = torch.gather(logits, dim=2, index=labels).squeeze(2)
        reward = (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
        reward = reward[0].cpu().detach()
        if torch.isnan(reward) or torch.isinf(reward):
            return -11.0
        return reward.item()


def close(a: float, b: float, rel: float = 1e-4) -> bool:
    """Equal within `rel` relative (absolute near zero)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def reference_dahoas(body: Any, head: Any, tokenizer: Any, prompt: str, completion: str) -> float:
    """The spec's Dahoas reward, literally: pad to 550 with eos, value before the first pad."""
    pad_id = tokenizer.eos_token_id

    def score(text: str) -> float:
        enc = tokenizer(
            ["<|startoftext|>" + text + "<|endoftext|>"], truncation=False, max_length=550,
            padding="max_length", return_tensors="pt",
        )
        ids = enc.input_ids.clone()
        ids[enc.attention_mask == 0] = pad_id  # pad = eos
        with torch.no_grad():
            hidden = body(input_ids=ids, attention_mask=enc.attention_mask).last_hidden_state
            values = head(hidden).squeeze(-1)
        inds = (ids[0] == pad_id).nonzero()
        c_ind = inds[0].item() if len(inds) > 0 else ids.shape[1]
        return float(values[0, c_ind - 1])

    return score(prompt + completion) - score(completion)
