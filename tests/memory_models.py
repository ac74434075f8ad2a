"""Tiny models of each scorer family's architecture, built in memory from configs, for the memory tests and bench
(`bench/memory.py`, which puts tests/ on its path).

Random weights, real code paths: DeBERTa-v2 with relative attention (the OpenAssistant reward model),
RoBERTa (the NSFW filter), BERT/MiniLM (the embedding filters), GPT-J (the reciprocate/dahoas reward
models), Llama (the causal-LM scorers, with chunked logits). Each comes with `run(B, L)`, a forward
pass over a B x L batch of random ids, as a scorer's calibration would do.
"""

from __future__ import annotations

from typing import Callable

import torch

VOCAB = 1000
LOGIT_CHUNK = 128  # positions per logits chunk in the causal-LM run (pass as calibrate(chunk=))


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(5, VOCAB, (batch, length))


def build(family: str, *, hidden: int = 64, layers: int = 2, max_positions: int = 4096) -> tuple[torch.nn.Module, Callable[[int, int], object]]:
    """(model in eval mode, run(B, L)) for one of: deberta, roberta, bert, gptj, llama."""
    import transformers as tf

    torch.manual_seed(0)
    heads = 4
    inter = hidden * 2
    if family == "deberta":
        cfg = tf.DebertaV2Config(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                 intermediate_size=inter, max_position_embeddings=512, relative_attention=True,
                                 position_buckets=256, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                                 position_biased_input=False, num_labels=1)
        model = tf.DebertaV2ForSequenceClassification(cfg)
    elif family == "roberta":
        cfg = tf.RobertaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               intermediate_size=inter, max_position_embeddings=max_positions + 2, num_labels=2)
        model = tf.RobertaForSequenceClassification(cfg)
    elif family == "bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=inter, max_position_embeddings=max_positions)
        model = tf.BertModel(cfg)
    elif family == "gptj":
        cfg = tf.GPTJConfig(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, rotary_dim=hidden // heads,
                            n_positions=max_positions, num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.GPTJForSequenceClassification(cfg)
    elif family == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=2, intermediate_size=inter, max_position_embeddings=max_positions,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown family {family!r}")
    model.eval()
    model.requires_grad_(False)

    if family == "llama":
        def run(batch: int, length: int, chunk: int = LOGIT_CHUNK) -> object:
            # The DPO scorer's pattern: run the body once, project to the vocabulary in chunks of
            # positions so the B x L x V logits never exist at once.
            ids = _ids(batch, length)
            h = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            total = torch.zeros(batch)
            for s in range(0, length - 1, chunk):
                logits = model.lm_head(h[:, s:s + chunk]).float()
                lp = torch.log_softmax(logits, dim=-1)
                tgt = ids[:, s + 1:s + 1 + chunk]
                total += lp[:, : tgt.shape[1]].gather(-1, tgt.unsqueeze(-1)).squeeze(-1).sum(-1)
                del logits, lp
            return total
    else:
        def run(batch: int, length: int) -> object:
            ids = _ids(batch, length)
            return model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return model, run


FAMILIES = ("deberta", "roberta", "bert", "gptj", "llama")
