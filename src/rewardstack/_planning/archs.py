"""Architectures of the full-size simulation, and their models built on the meta device.

An `Arch` is a transformers config.json (shipped in `rewardstack/configs/archs/`, or a local
folder's); `meta_modules(model, dtype, arch)` builds the scorer's modules from it on the meta
device, where they have sizes and no data, cached per architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from rewardstack.errors import RewardStackError
from rewardstack._models import spec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SimulationError(RewardStackError):
    """A model or step the simulation cannot run (no architecture, a value it cannot answer)."""


# -- architectures ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """An architecture config: transformers' config.json fields plus where they come from."""

    name: str
    fields: dict = field(hash=False, compare=False)
    hub_ids: tuple[str, ...] = ()
    source: str = ""
    stand_in: str = ""  # set when the architecture stands in for one transformers lacks
    remote_code: str = ""  # package holding the `auto_map` modules (remote-code architectures)

    def remote_class(self, auto: str) -> Any:
        """The class `auto_map` names for `auto`, from the `remote_code` package (no download)."""
        import importlib

        module, cls = self.fields["auto_map"][auto].rsplit(".", 1)
        return getattr(importlib.import_module(f"{self.remote_code}.{module.split('--')[-1]}"), cls)

    def key(self) -> str:
        """A stable key for caches: the name and the fields."""
        return self.name + ":" + json.dumps(self.fields, sort_keys=True)

    def config(self, layers: int | None = None) -> Any:
        """The transformers config object (attention implementation set when the file asks);
        `layers` overrides the depth (the fast simulation runs 2 and 3 layers)."""
        from transformers import AutoConfig

        f = {k: v for k, v in self.fields.items() if not k.startswith("_") and k not in ("model_type", "attn_implementation")}
        if self.remote_code:
            cfg = self.remote_class("AutoConfig")(**{k: v for k, v in f.items() if k not in ("auto_map", "architectures")})
        else:
            cfg = AutoConfig.for_model(self.fields["model_type"], **f)
        if layers is not None:
            cfg.num_hidden_layers = layers  # GPT-J maps it to n_layer
        if "attn_implementation" in self.fields:  # else transformers' own choice (sdpa where supported)
            cfg._attn_implementation = self.fields["attn_implementation"]
        return cfg


def _read_arch(name: str, text: str, source: str = "") -> Arch:
    """An architecture from a config.json's text; a shipped file's `_rewardstack` entry says where it comes from."""
    data = json.loads(text)
    meta = data.pop("_rewardstack", {})
    return Arch(name, data, tuple(meta.get("hub_ids", ())), meta.get("source", source), meta.get("stand_in", ""),
                meta.get("remote_code", ""))


@lru_cache(maxsize=None)
def shipped_archs() -> dict[str, Arch]:
    """The architecture configs shipped in `rewardstack/configs/archs/`, by file stem."""
    files = sorted(resources.files("rewardstack").joinpath("configs", "archs").iterdir(), key=lambda e: e.name)
    return {e.name[:-5]: _read_arch(e.name[:-5], e.read_text(encoding="utf-8"))
            for e in files if e.name.endswith(".json")}


def load_arch(path: str) -> Arch:
    """The architecture of a config's model path: a local folder's config.json, a shipped JSON
    whose hub ids name `path`, a shipped file stem, or a .json file. Nothing is downloaded."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").exists():
        arch = _read_arch(p.name, (p / "config.json").read_text(encoding="utf-8"), str(p / "config.json"))
        if "model_type" not in arch.fields:
            raise SimulationError(f"{p / 'config.json'} has no model_type")
        return arch
    if p.suffix == ".json" and p.is_file():
        return _read_arch(p.stem, p.read_text(encoding="utf-8"), str(p))
    archs = shipped_archs()
    if path in archs:
        return archs[path]
    for arch in archs.values():
        if path in arch.hub_ids:
            return arch
    raise SimulationError(
        f"no architecture for {path!r}: not a local folder with config.json, and no shipped "
        f"config names it (shipped: {', '.join(a for arch in archs.values() for a in arch.hub_ids)})"
    )


# -- meta models ---------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _meta_model(arch_key: str, auto: str, dtype_name: str, layers: int | None = None) -> tuple[torch.nn.Module, ...]:
    import transformers

    arch = _ARCHS_BY_KEY[arch_key]
    conf = arch.config(layers)
    dtype = DTYPES[dtype_name]
    with torch.device("meta"):
        if auto == "GPTJModel":  # Dahoas: GPT-J body + bias-free value head
            body = transformers.GPTJModel(conf).to(dtype)
            head = torch.nn.Linear(conf.n_embd, 1, bias=False).to(dtype)
            mods: tuple[torch.nn.Module, ...] = (body, head)
        elif arch.remote_code:
            mods = (arch.remote_class(auto)(conf).to(dtype),)
        else:
            cls = getattr(transformers, auto)
            mods = (cls.from_config(conf, dtype=dtype),)
    for m in mods:
        m.eval()
        m.requires_grad_(False)
    if arch.remote_code:  # the scorer's load-time replacement, planned as installed (no probe on meta)
        from rewardstack._scorers import attention

        attention.install(arch.name, mods[0].base_model, verify=False)
    return mods


_ARCHS_BY_KEY: dict[str, Arch] = {}


def meta_modules(model: str, dtype: str, arch: Arch, layers: int | None = None) -> tuple[torch.nn.Module, ...]:
    """The scorer's modules built on the meta device in `dtype` (cached per architecture);
    `layers`: that many transformer layers instead of the architecture's."""
    _ARCHS_BY_KEY[arch.key()] = arch
    return _meta_model(arch.key(), spec(model).simulated.auto_class, dtype, layers)
