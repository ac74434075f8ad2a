"""Full-size memory simulation on CPU: each scorer's forward pass on the meta device, tracked.

A model is built from its architecture config on the meta device (no weights, no download); its
scorer's forward pass runs on meta tensors made from token lengths (no tokenizer) under the
tensor-bytes tracker, which charges every storage an aten op creates exactly as it charges real
ones. No arithmetic runs and nothing is estimated by formula: the peak is what the ops would
allocate, so a laptop knows what DeBERTa-v3-large needs at 8,600 tokens or GPT-J with a 1,500-token
shared prefix at batch 16, in any dtype.

What runs as the scorer runs it (transformers' own forward code, the scorer's own helpers):
  - encoders (`rlhf_reward_model`, `nsfw_filter`, `relevance_filter[0|1]`, `diversity_reward_model`):
    `encoding.pad_batch`, the model, the scorer's head;
  - `reciprocate_reward_model`, `dahoas_reward_model`: `prefix.PrefixRunner` (the shared prefix's
    pass and its K/V cache expanded to the batch, then the suffix pass) and the head on the rows read;
  - `dpo_reward_model`: `PrefixRunner` for the body, `dpo.LogitHead` for the logits chunk.
What is modelled from shapes, because it needs values (each replaced step allocates the same
tensors, with the same lifetimes, as the code it stands for):
  - DPO's penalty bookkeeping: the scorer's own `dpo.chunked_logprobs` runs in its shape-only
    mode (`dpo.PenaltyShapes`): which token columns a chunk penalizes depends on the ids, so the
    mode takes the upper bound, every scored token distinct (random profile ids come close to it;
    natural text stays below);
  - the judge's generation (`JudgeScorer.generate` -> `model.generate`): the prefill pass with
    `logits_to_keep=1` and a DynamicCache, then one decode step per new token, as transformers'
    greedy loop runs them; its stopping bookkeeping (a few [B] tensors) is left out;
  - the one value a forward pass reads (`attention_mask.all()`: is there padding?) is answered from
    the lengths: a batch is padded (its last row one token short) unless `padded=False`.
Scaled-dot-product attention is charged as the fused kernels that run it on CPU and CUDA allocate:
its output and float32 log-sum-exp, never L x L scores. (Under inference mode, where scorers and the
simulation run, torch dispatches it as one op whose internals the tracker does not see; outside it
the meta device would decompose it into the math fallback, so the simulation pins the fused
kernel's meta function either way.) Models with their own attention
(DeBERTa's disentangled attention, MPNet's relative bias, eager attention) build the scores on
every device, and the simulation charges them.

Not charged (as for the tracker): memory a kernel allocates and frees internally (cuBLAS or fused
attention workspaces), allocator rounding, the CUDA context. `gpu_check.py` measures the gap.

Public API: `simulate_peak(model, batch, length, dtype)` -> `SimResult`;
`reference_need(model, n_tokens)` -> `SimResult` for what the unbounded openvalidators reference
call asks for; `load_arch(path)`; `scorer_bound(model)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from rewardstack._fileio import atomic_write_text
from rewardstack._memory.budget import weights_bytes
from rewardstack._models import MODELS, checkpoint_index, is_user_model, owner_of, spec
from rewardstack._planning import passes
from rewardstack._planning.archs import DTYPES, Arch, SimulationError, load_arch, meta_modules
from rewardstack._planning.metadevice import measure_meta

# -- which model each scorer runs, and how -------------------------------------------------------

SCORERS: dict[str, tuple[str, str]] = {
    run: (m.simulated.family, m.simulated.auto_class) for m in MODELS if m.simulated is not None for run in m.runs()
}
"""The fixed models' runs -> (scorer family, transformers auto class), from the registry's `simulated` entries;
a user-named reward model (`rewards.<name>`) runs `HF_REWARD`'s (`spec(run).simulated` answers for every run)."""


def _model_cfg(model: str, config: Any | None) -> Any:
    from rewardstack.config import default_config

    cfg = config if config is not None else default_config()
    owner = owner_of(model)
    if owner not in cfg.models:
        raise SimulationError(f"unknown model {model!r}; expected one of: {', '.join(SCORERS)}")
    return cfg.models[owner]


def model_path(model: str, config: Any | None = None) -> str:
    """The checkpoint path (hub id or folder) that a scorer loads, from the stack's config."""
    mc = _model_cfg(model, config)
    if "[" in model:
        return mc.paths[checkpoint_index(model)]
    if mc.path is None:
        raise SimulationError(f"{model}: no path in the config")
    return mc.path


def model_dtype(model: str, config: Any | None = None) -> str:
    """The dtype the config loads a model in."""
    return _model_cfg(model, config).dtype


def scorer_bound(model: str, config: Any | None = None, arch: Arch | None = None) -> int:
    """The longest input (tokens) the scorer admits, from the config and the architecture alone.

    The scorers take the tokenizer's `model_max_length` where it is sane; without a tokenizer the
    position limits stand in, which give the same numbers for the default stack's models
    (OpenAssistant 512, encoders 512, GPT-J 2048, BTLM 8192, the judge 2048 - 2 new tokens).
    """
    from rewardstack._scorers import encoding as enc

    mc = _model_cfg(model, config)
    arch = arch or load_arch(model_path(model, config))
    conf = arch.config()
    kind = spec(model).simulated.family
    if kind in ("classifier", "encoder"):
        default = spec(model).tokenizer_length  # the published tokenizer's bound, in its stead
        bound = enc.resolve_max_length(None, conf, mc.max_length, default)
        return bound
    positions = next((int(getattr(conf, k)) for k in ("n_positions", "max_position_embeddings") if getattr(conf, k, None)), 2048)
    if kind == "judge":
        return min(mc.max_length or positions, mc.options.max_input) - 2
    return min(mc.max_length or positions, positions)


# -- the simulated device ------------------------------------------------------------------------

@dataclass
class SimResult:
    """Peak activation bytes of one simulated pass, and the largest single allocation in it."""

    model: str
    batch: int
    length: int
    dtype: str
    prefix: int = 0
    peak_bytes: int = 0  # above what was live before the pass (weights are never charged)
    largest_alloc_bytes: int = 0
    largest_alloc_op: str = ""
    largest_alloc_shape: tuple[int, ...] = ()
    largest_alloc_module: str = ""
    weights_bytes: int = 0
    modelled: tuple[str, ...] = ()
    attention: str = ""  # which attention the pass ran (`scorers.attention.attention_of`)


# -- the public API ------------------------------------------------------------------------------

_CACHE: dict[tuple, SimResult] = {}
_DISK: Path | None = None  # folder of the on-disk cache (`use_disk_cache`); None: memory only


def use_disk_cache(folder: str | Path | None) -> None:
    """Keep simulated results in `folder` across runs, one JSON file per architecture and dtype
    (None: in memory only). Entries are keyed by the code that produced them (this module, the
    scorer helpers it runs, torch and transformers versions), so a change to any of them starts afresh."""
    global _DISK
    _DISK = Path(folder) if folder is not None else None


@lru_cache(maxsize=1)
def _code_version() -> str:
    """A digest of the code a simulated number depends on."""
    import transformers

    from rewardstack._scorers import attention, classifier, dpo, dpo_numerics, embedding, encoding, prefix

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    from rewardstack._planning import archs, btlm, metadevice

    for mod in (__import__(__name__, fromlist=["_"]), archs, metadevice, passes, attention, classifier, dpo, dpo_numerics,
                embedding, encoding, prefix):
        h.update(Path(mod.__file__).read_bytes())
    for f in sorted(Path(btlm.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _disk_file(arch: Arch, dtype: str) -> Path:
    assert _DISK is not None
    return _DISK / f"{arch.name}-{dtype}-{hashlib.sha256(arch.key().encode()).hexdigest()[:12]}.json"


def _disk_read(arch: Arch, dtype: str) -> dict[str, Any]:
    """The on-disk cache of (arch, dtype) when this code wrote it (`_code_version`), else empty."""
    try:
        data = json.loads(_disk_file(arch, dtype).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if data.get("code") == _code_version() else {}


def simulate_peak(
    model: str,
    batch: int,
    length: int,
    dtype: str | None = None,
    *,
    prefix: int = 0,
    prompt: int = 1,
    padded: bool = True,
    chunk: int = 512,
    config: Any | None = None,
    arch: Arch | None = None,
    exact: bool = True,
    block: int | None = None,
) -> SimResult:
    """Simulated peak activation bytes of one scorer pass over `batch` inputs of `length` tokens.

    `model`: a scorer name (`rlhf_reward_model`, `relevance_filter[0]`, ...); its checkpoint and
    dtype come from `config` (default: the openvalidators default stack) unless `arch` / `dtype`
    say otherwise. Decoders: `prefix` tokens shared by the batch run once first (and stay live, as
    the scorer keeps them); DPO scores rows after `prompt` tokens in chunks of `chunk` rows.
    `padded`: the batch carries padding (its last row one token short), as scoring batches do.
    `exact=False` runs the model with 2 and 3 layers and extends the difference to the full depth:
    the layers are identical, so what one more layer adds (its K/V cache; nothing for an encoder)
    is the same for each (from the second layer on: the first has no earlier layer's output to
    keep), and the pass is ~5x faster (`rewardstack plan` uses it;
    tests/test_simulate.py checks it against the full-depth run for every default model).
    `block`: query rows per block of a model running blocked attention (None: the scorer's
    default, `attention.ATTENTION_BLOCK`). Results are cached per arguments.
    """
    if model not in SCORERS and not is_user_model(model):
        raise SimulationError(f"unknown model {model!r}; expected one of: {', '.join(SCORERS)}")
    if batch < 1 or length < 1 or not 0 <= prefix < length:
        raise SimulationError(f"need batch >= 1, length >= 1 and 0 <= prefix < length (got {batch}, {length}, {prefix})")
    arch = arch or load_arch(model_path(model, config))
    dtype = dtype or model_dtype(model, config)
    if dtype not in DTYPES:
        raise SimulationError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kind = spec(model).simulated.family
    # Scorers that run the same architecture the same way share results (relevance [1], diversity).
    same = "pooled" if kind == "encoder" else model
    key = (same, arch.key(), dtype, batch, length, prefix if kind in ("reciprocate", "dahoas", "dpo") else 0,
           prompt if kind == "dpo" else 0, padded, chunk if kind == "dpo" else 0, exact) + ((block,) if block else ())
    hit = _disk_read(arch, dtype).get("results", {}).get(repr(key)) if key not in _CACHE and _DISK else None
    if hit is not None:  # JSON holds the tuples as lists
        _CACHE[key] = SimResult(**{**hit, "largest_alloc_shape": tuple(hit["largest_alloc_shape"]),
                                   "modelled": tuple(hit["modelled"])})
    if key in _CACHE:
        hit = _CACHE[key]
        return hit if hit.model == model else dataclasses.replace(hit, model=model)

    def at_depth(layers: int | None) -> SimResult:
        mods = meta_modules(model, dtype, arch, layers)
        # Remote code of the transformers 4.x era takes tuple caches, not cache objects: the decoder
        # scorers' load probe sends it to full sequences (no shared-prefix pass).
        return _simulate(model, kind, mods, batch, length, dtype, prefix, prompt, padded, chunk,
                         bool(arch.remote_code), block)

    n = int(arch.config().num_hidden_layers)
    res = at_depth(None if exact or n <= 3 else 3)
    if not exact and n > 3:
        res.peak_bytes = res.peak_bytes + (n - 3) * (res.peak_bytes - at_depth(2).peak_bytes)
    res.weights_bytes = weights_bytes(meta_modules(model, dtype, arch))
    _CACHE[key] = res
    if _DISK is not None:
        data = _disk_read(arch, dtype)
        data.setdefault("results", {})[repr(key)] = dataclasses.asdict(res)
        # Atomic: a killed run leaves the old file.
        atomic_write_text(_disk_file(arch, dtype), json.dumps({**data, "code": _code_version()}))
    return res


def _simulate(model: str, kind: str, mods: tuple, batch: int, length: int, dtype: str, prefix: int,
              prompt: int, padded: bool, chunk: int, legacy: bool = False, block: int | None = None) -> SimResult:
    from rewardstack._scorers.attention import attention_of

    rows = passes.rows_of(batch, length, padded)
    if kind in ("classifier", "encoder"):
        run = passes.encoder_pass(model, mods, rows, pair=spec(model).pair_input)
    elif kind in ("reciprocate", "dahoas"):  # Dahoas: (GPT-J body, value head); Reciprocate: one model
        body, head = (mods[0].base_model, mods[0].score) if kind == "reciprocate" else mods
        run = passes.decoder_pass(body, head, rows, prefix)
    elif kind == "dpo":
        run = passes.dpo_pass(mods, rows, 0 if legacy else prefix, max(prompt, prefix), chunk, block)
    else:
        run = passes.judge_pass(mods, rows)
    full = not (padded and batch > 1 and length > 1)
    peak, (lbytes, lop, lshape, lmod) = measure_meta(run, mods, full=full)
    return SimResult(model, batch, length, dtype, prefix, int(peak), lbytes, lop, tuple(lshape), lmod,
                     modelled=spec(model).modelled, attention=attention_of(mods[0]))


def reference_need(model: str, n_tokens: int, *, config: Any | None = None, dtype: str | None = None,
                   exact: bool = False) -> SimResult:
    """What the unbounded openvalidators reference call asks for on one input of `n_tokens` tokens.

    The reference scores one completion per call, untruncated where it did not truncate:
    OpenAssistant (`rlhf_reward_model`) runs DeBERTa-v3-large in float32 (it passes no dtype) on
    the whole (prompt, completion) pair, which is the seed report's 4.40 GiB allocation at about
    8,600 tokens. The other models are simulated as their pass at batch 1 and `n_tokens` tokens
    in the configured dtype (the reference truncated those to their position limits, so pass
    `n_tokens` no longer than `scorer_bound`). `largest_alloc_bytes` is the figure CUDA's OOM
    message prints as "Tried to allocate"; `peak_bytes` is what the call needs at its peak.
    """
    if spec(model).reference_dtype:
        dtype = dtype or spec(model).reference_dtype  # the reference loads it with no dtype
    return simulate_peak(model, 1, n_tokens, dtype, padded=False, config=config, exact=exact)


def active_models(config: Any) -> list[str]:
    """The neural models a stack runs, by scorer name (the relevance filter's two as [0] and [1])."""
    out: list[str] = []
    for name, mc in config.models.items():
        if not mc.active or (name not in {owner_of(n) for n in SCORERS} and not is_user_model(name)):
            continue
        out += [f"{name}[{k}]" for k in range(len(mc.paths))] if spec(name).checkpoints > 1 else [name]
    return out
