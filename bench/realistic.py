"""A reward model of realistic proportions and the chat texts a trainer sends it, built offline.

The model: a `LlamaForSequenceClassification` (6 layers, hidden 384, intermediate 1536, 6 heads,
2 key-value heads, `num_labels = 1`, float32, SDPA attention, about 25M parameters) with random
weights drawn from its config under a seed, saved with `save_pretrained`. Its tokenizer is a real
one, all-mpnet-base-v2's WordPiece (from the real-checkpoint cache, `bench.realmodels`), made to
act like Llama-3's: a `<|begin_of_text|>` BOS that the post-processor prepends (and no EOS), the
Llama-3 header and turn tokens, a pad token, `model_max_length = 512`, and Llama-3-Instruct's chat
template, which writes the BOS itself. So a templated text tokenized with `add_special_tokens=True`
carries two BOS tokens, as it does with Llama-3; OpenRLHF's executor sends such text and its
`serve_rm.py` tokenizes it without special tokens.

`cached_model()` builds the folder once under the real-checkpoint cache (`bench.realmodels
.default_cache()`, which `bench.common.own_home` leaves in place) and reuses it; `chat_texts(n)`
gives `n` chat-templated prompt+response texts under this tokenizer, deterministically: about 85%
between 100 and 500 tokens (median near 190), about 15% past 512 (cut at the model's bound).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from bench import realtexts
from bench.realmodels import default_cache, locate

MAX_LENGTH = 512
BOS, EOT, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
HEADERS = ("<|start_header_id|>", "<|end_header_id|>")
# Llama-3-Instruct's chat template as its tokenizer_config.json gives it: the BOS is written here.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SHAPE = {"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 1536, "num_attention_heads": 6,
         "num_key_value_heads": 2}
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2}
"""A tiny model of the same kind and tokenizer, for smoke runs (`build_model(..., shape=TINY)`)."""
STAMP = "rewardstack-realistic.json"


def _llama3_tokenizer(source: Path) -> Any:
    """all-mpnet-base-v2's WordPiece tokenizer acting as Llama-3's (see the module docstring)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(source / "tokenizer.json"))
    raw.no_truncation()  # the hub file carries a fixed 128-token truncation and padding
    raw.no_padding()
    raw.add_special_tokens([BOS, EOS, EOT, PAD, *HEADERS])
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, raw.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOT, pad_token=PAD,
                                   unk_token="[UNK]", model_max_length=MAX_LENGTH, chat_template=CHAT_TEMPLATE,
                                   padding_side="right", truncation_side="right")


def _spec(seed: int, shape: dict[str, int]) -> dict[str, Any]:
    return {"seed": seed, "shape": shape, "tokenizer": "all-mpnet-base-v2 as Llama-3", "version": 1}


def build_model(folder: Path, seed: int = 0, shape: dict[str, int] | None = None) -> Path:
    """The realistic reward model saved in `folder` (reused when a build of the same spec is there)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = Path(folder)
    spec = _spec(seed, dict(shape or SHAPE))
    if (folder / STAMP).is_file() and json.loads((folder / STAMP).read_text()) == spec:
        return folder
    tok = tokenizer()
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, rope_theta=500000.0, num_labels=1,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, attn_implementation="sdpa", dtype="float32", **spec["shape"])
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).to(torch.float32).eval()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(spec))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # one rename: a killed build leaves no half-made folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def cached_model(seed: int = 0, shape: dict[str, int] | None = None) -> Path:
    """`build_model` into the real-checkpoint cache, named by its spec: built once, then reused."""
    digest = hashlib.sha256(json.dumps(_spec(seed, dict(shape or SHAPE)), sort_keys=True).encode()).hexdigest()[:10]
    return build_model(default_cache() / f"realistic-llama-rm-{digest}", seed, shape)


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The realistic model's tokenizer (every shape saves this one)."""
    return _llama3_tokenizer(locate().mpnet)


def _target_lengths(n: int, rng: random.Random) -> list[int]:
    """Token lengths: 15% past 512, the rest log-normal (median 190) within 100-500."""
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append(rng.randint(MAX_LENGTH + 8, 2 * MAX_LENGTH))
        else:
            out.append(min(500, max(100, round(math.exp(rng.gauss(math.log(190), 0.45))))))
    return out


def chat_texts(n: int, seed: int = 0) -> list[str]:
    """`n` Llama-3 chat-templated prompt+response texts (BOS written in) of the lengths above."""
    tok = tokenizer()
    rng = random.Random(seed)
    prompts, passages = realtexts.prompts(), realtexts.passages()
    vocab = sorted({w for p in passages for w in p.split()})
    # WordPiece splits at white space before anything else, so a text's count is the sum of its words'.
    count = dict(zip(vocab, map(len, tok(vocab, add_special_tokens=False)["input_ids"])))
    out = []
    for target in _target_lengths(n, rng):
        prompt = rng.choice(prompts) if rng.random() < 0.5 else rng.choice(passages) + " " + rng.choice(prompts)
        words: list[str] = []
        while len(words) < 2 * target:
            words += rng.choice(passages).split()

        def render(k: int) -> str:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": " ".join(words[:k])}]
            return tok.apply_chat_template(chat, tokenize=False)

        total = len(tok(render(0), add_special_tokens=False)["input_ids"])
        k = 0
        while total < target:  # the fewest words whose text reaches the target length
            total += count[words[k]]
            k += 1
        out.append(render(k))
    return out
