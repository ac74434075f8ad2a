"""OpenRLHF's reward-model server, `openrlhf/cli/serve_rm.py`, for the tests to score with.

Repository OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7, file
openrlhf/cli/serve_rm.py. Between the BEGIN and END markers is that file unchanged, but for its
model loader: these four import lines were taken out,

    from openrlhf.models import get_llm_for_sequence_regression
    from openrlhf.utils import get_tokenizer
    from openrlhf.utils.config import hierarchize
    from openrlhf.utils.logging_utils import init_logger

(OpenRLHF's package imports deepspeed, peft and flash-attn, which CPU CI does not install), and the
definitions above the markers stand in for them:

- `get_llm_for_sequence_regression`: the checkpoint read with transformers'
  `AutoModelForSequenceClassification` in float32 (its `model` and `score` are the `base_model_prefix`
  module and the `score` value head OpenRLHF's `RewardModel` loads), with the forward of OpenRLHF's
  `RewardModel` (openrlhf/models/model.py, `_get_reward_model`, packing off): positions counted from
  the attention mask, the value head's output at each row's last attended token;
- `get_tokenizer`: openrlhf/utils/utils.py's, its non-VLM branch;
- `hierarchize` (openrlhf/utils/config.py) and `init_logger` (a plain logger).

`RewardModelProxy(args).get_reward(queries)` is what serve_rm's `/get_reward` answers as `rewards`.
tests/test_trainers.py checks the block against the fetched file when `REWARDSTACK_TRAINER_SOURCES`
names an OpenRLHF git directory.
"""

# ruff: noqa
import logging
from types import SimpleNamespace

import torch


def init_logger(name):
    return logging.getLogger(name)


def hierarchize(args):
    root = {}
    for k, v in vars(args).items():
        parts = k.split(".")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v

    def build(x):
        if isinstance(x, dict):
            return SimpleNamespace(**{k: build(v) for k, v in x.items()})
        return x

    return build(root)


def get_llm_for_sequence_regression(model_name_or_path, model_type, *, normalize_reward=False,
                                    value_head_prefix="score", **_ignored):
    from transformers import AutoModelForSequenceClassification

    assert model_type == "reward" and not normalize_reward
    hf = AutoModelForSequenceClassification.from_pretrained(model_name_or_path, dtype=torch.float32)

    class RewardModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf
            self.config = hf.config

        @property
        def device(self):
            return hf.device

        def forward(self, input_ids, attention_mask):
            eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            outputs = getattr(hf, hf.base_model_prefix)(input_ids, attention_mask=attention_mask, position_ids=position_ids)
            values = getattr(hf, value_head_prefix)(outputs["last_hidden_state"]).squeeze(-1)
            return values.gather(dim=1, index=eos_indices).squeeze(1)

    return RewardModel().eval()


def get_tokenizer(pretrain, model, padding_side="left", strategy=None, use_fast=True):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrain, trust_remote_code=True, use_fast=use_fast)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.pad_token_id = tokenizer.eos_token_id
    if model is not None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


# BEGIN OpenRLHF openrlhf/cli/serve_rm.py
import argparse

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


logger = init_logger(__name__)


class RewardModelProxy:
    def __init__(self, args):
        self.reward_model = get_llm_for_sequence_regression(
            args.reward.model_name_or_path,
            "reward",
            normalize_reward=args.reward.normalize_enable,
            attn_implementation=args.ds.attn_implementation,
            experts_implementation=args.ds.experts_implementation,
            param_dtype=args.ds.param_dtype,  # default: bf16
            load_in_4bit=args.ds.load_in_4bit,
            value_head_prefix=args.ds.value_head_prefix,
            device_map="auto",
            packing_samples=args.ds.packing_samples,
        )
        self.reward_model.eval()

        self.tokenizer = get_tokenizer(
            args.reward.model_name_or_path,
            self.reward_model,
            "left",
            None,
            use_fast=not args.data.disable_fast_tokenizer,
        )
        self.max_length = args.data.max_len
        self.batch_size = args.batch_size

    def get_reward(self, queries):
        if self.batch_size is None:
            batch_size = len(queries)
        else:
            batch_size = self.batch_size

        logger.info(f"queries[0]: {queries[0]}")

        scores = []
        # batch
        with torch.no_grad():
            for i in range(0, len(queries), batch_size):
                inputs = self.tokenize_fn(
                    queries[i : min(len(queries), i + batch_size)], device=self.reward_model.device
                )
                r = self.reward_model(inputs["input_ids"], inputs["attention_mask"])
                r = r.tolist()
                scores.extend(r)
        return scores

    def tokenize_fn(self, texts, device):
        batch = self.tokenizer(
            texts,
            return_tensors="pt",
            add_special_tokens=False,
            max_length=self.max_length,
            padding=True,
            truncation=True,
        )
        return {k: v.to(device) for k, v in batch.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    # Reward Model
    parser.add_argument("--reward.model_name_or_path", type=str, default=None, help="HF model name or path")
    parser.add_argument(
        "--reward.normalize_enable", action="store_true", default=False, help="Enable Reward Normalization"
    )
    parser.add_argument("--ds.value_head_prefix", type=str, default="score")
    parser.add_argument("--data.max_len", type=int, default=2048)

    parser.add_argument("--port", type=int, default=5000, help="Port number for the server")
    parser.add_argument("--host", type=str, default="0.0.0.0", help="IP for the server")

    # Performance
    parser.add_argument("--ds.load_in_4bit", action="store_true", default=False)
    parser.add_argument(
        "--ds.param_dtype",
        type=str,
        default="bf16",
        choices=["bf16", "fp16"],
        help="Model data type",
    )
    parser.add_argument(
        "--ds.attn_implementation",
        type=str,
        default="flash_attention_2",
        help="Attention implementation (e.g., eager, flash_attention_2, flash_attention_3, kernels-community/vllm-flash-attn3)",
    )
    parser.add_argument(
        "--ds.experts_implementation",
        type=str,
        default=None,
        choices=["eager", "batched_mm", "grouped_mm", "deepgemm"],
        help="MoE expert computation strategy passed to transformers from_pretrained (default: auto — transformers picks grouped_mm when supported, else eager)",
    )
    parser.add_argument("--data.disable_fast_tokenizer", action="store_true", default=False)
    parser.add_argument("--ds.packing_samples", action="store_true", default=False)
    parser.add_argument("--batch_size", type=int, default=None)

    # ModelScope parameters
    parser.add_argument("--use_ms", action="store_true", default=False)

    args = hierarchize(parser.parse_args())

    if args.use_ms:
        from modelscope.utils.hf_util import patch_hub

        # Patch hub to download models from modelscope to speed up.
        patch_hub()

    # server
    reward_model = RewardModelProxy(args)
    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(request: Request):
        data = await request.json()
        queries = data.get("query")
        rewards = reward_model.get_reward(queries)
        result = {"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}}
        logger.info(f"Sent JSON: {result}")
        return JSONResponse(result)

    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
# END OpenRLHF
