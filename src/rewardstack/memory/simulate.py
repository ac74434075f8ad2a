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
  - DPO's penalty bookkeeping (`dpo.chunked_logprobs`): which token columns a chunk penalizes
    depends on the ids; the simulation takes the upper bound, every scored token distinct (random
    profile ids come close to it; natural text stays below);
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
call asks for; `load_arch(path)`; `weights_bytes_of(model, dtype)`; `scorer_bound(model)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten

from rewardstack.errors import RewardStackError
from rewardstack.memory.tracker import TensorBytesTracker, _storage_of

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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

    @property
    def legacy_cache(self) -> bool:
        """Remote code of the transformers 4.x era takes tuple caches, not cache objects: the
        decoder scorers' load probe sends it to full sequences (no shared-prefix pass)."""
        return bool(self.remote_code)

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


def _arch_dir() -> Any:
    return resources.files("rewardstack") / "configs" / "archs"


@lru_cache(maxsize=None)
def shipped_archs() -> dict[str, Arch]:
    """The architecture configs shipped in `rewardstack/configs/archs/`, by file stem."""
    out: dict[str, Arch] = {}
    for entry in sorted(_arch_dir().iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        data = json.loads(entry.read_text(encoding="utf-8"))
        meta = data.pop("_rewardstack", {})
        stem = entry.name[: -len(".json")]
        out[stem] = Arch(stem, data, tuple(meta.get("hub_ids", ())), meta.get("source", ""), meta.get("stand_in", ""),
                         meta.get("remote_code", ""))
    return out


def load_arch(path: str) -> Arch:
    """The architecture of a config's model path: a local folder's config.json, a shipped JSON
    whose hub ids name `path`, a shipped file stem, or a .json file. Nothing is downloaded."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").exists():
        data = json.loads((p / "config.json").read_text(encoding="utf-8"))
        if "model_type" not in data:
            raise SimulationError(f"{p / 'config.json'} has no model_type")
        return Arch(p.name, data, (), f"{p / 'config.json'}")
    if p.suffix == ".json" and p.is_file():
        data = json.loads(p.read_text(encoding="utf-8"))
        meta = data.pop("_rewardstack", {})
        return Arch(p.stem, data, tuple(meta.get("hub_ids", ())), meta.get("source", str(p)), meta.get("stand_in", ""),
                    meta.get("remote_code", ""))
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


# -- which model each scorer runs, and how -------------------------------------------------------

# scorer name -> (kind, transformers auto class). The kinds are the scorer families below.
SCORERS: dict[str, tuple[str, str]] = {
    "rlhf_reward_model": ("classifier", "AutoModelForSequenceClassification"),
    "nsfw_filter": ("classifier", "AutoModelForSequenceClassification"),
    "relevance_filter[0]": ("encoder", "AutoModel"),
    "relevance_filter[1]": ("encoder", "AutoModel"),
    "diversity_reward_model": ("encoder", "AutoModel"),
    "reciprocate_reward_model": ("reciprocate", "AutoModelForSequenceClassification"),
    "dahoas_reward_model": ("dahoas", "GPTJModel"),
    "dpo_reward_model": ("dpo", "AutoModelForCausalLM"),
    "prompt_reward_model": ("judge", "AutoModelForCausalLM"),
}


def _model_cfg(model: str, config: Any | None) -> Any:
    from rewardstack.config import default_config

    cfg = config if config is not None else default_config()
    owner = model.split("[", 1)[0]
    if owner not in cfg.models:
        raise SimulationError(f"unknown model {model!r}; expected one of: {', '.join(SCORERS)}")
    return cfg.models[owner]


def model_path(model: str, config: Any | None = None) -> str:
    """The checkpoint path (hub id or folder) that a scorer loads, from the stack's config."""
    mc = _model_cfg(model, config)
    if "[" in model:
        k = int(model.split("[", 1)[1].rstrip("]"))
        return mc.paths[k]
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
    from rewardstack.scorers import encoding as enc

    mc = _model_cfg(model, config)
    arch = arch or load_arch(model_path(model, config))
    conf = arch.config()
    kind = SCORERS[model][0]
    if kind in ("classifier", "encoder"):
        default = 512 if model in ("rlhf_reward_model", "nsfw_filter") else None
        bound = enc.resolve_max_length(None, conf, mc.max_length, default)
        return bound
    positions = next((int(getattr(conf, k)) for k in ("n_positions", "max_position_embeddings") if getattr(conf, k, None)), 2048)
    if kind == "judge":
        cap = int(mc.options.get("max_input", 2048))
        return min(mc.max_length or positions, cap) - 2
    return min(mc.max_length or positions, positions)


# -- meta models ---------------------------------------------------------------------------------

def depth(arch: Arch) -> int:
    """The number of transformer layers of an architecture."""
    return int(arch.config().num_hidden_layers)


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
        from rewardstack.scorers import attention

        attention.install(arch.name, mods[0].base_model, verify=False)
    return mods


_ARCHS_BY_KEY: dict[str, Arch] = {}


def meta_modules(model: str, dtype: str, arch: Arch, layers: int | None = None) -> tuple[torch.nn.Module, ...]:
    """The scorer's modules built on the meta device in `dtype` (cached per architecture);
    `layers`: that many transformer layers instead of the architecture's."""
    _ARCHS_BY_KEY[arch.key()] = arch
    return _meta_model(arch.key(), SCORERS[model][1], dtype, layers)


def weights_bytes_of(modules: tuple[torch.nn.Module, ...] | list[torch.nn.Module]) -> int:
    """Parameter and buffer bytes of meta modules, shared (tied) tensors counted once."""
    seen: set[int] = set()
    total = 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            st = t.untyped_storage()
            if id(st) in seen:
                continue
            seen.add(id(st))
            total += t.numel() * t.element_size() if st.nbytes() == 0 else st.nbytes()
    return total


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
    arch: str = ""
    modelled: tuple[str, ...] = ()
    seconds: float = 0.0
    attention: str = ""  # which attention the pass ran (`scorers.attention.attention_of`)

    def describe(self) -> str:
        """One line for logs and reports."""
        gib = 1024**3
        return (f"{self.model} B={self.batch} L={self.length} {self.dtype}: peak {self.peak_bytes / gib:.3f} GiB, "
                f"largest {self.largest_alloc_bytes / gib:.3f} GiB {self.largest_alloc_op} "
                f"{list(self.largest_alloc_shape)} in {self.largest_alloc_module or '-'}")


class SimTracker(TensorBytesTracker):
    """The tensor-bytes tracker, also recording the largest single allocation and where it was made."""

    def __init__(self, budget_bytes: int | None = None, *, full: bool = True) -> None:
        super().__init__(budget_bytes)
        self.largest = (0, "", (), "")  # bytes, op, shape, module
        self.module_stack: list[str] = []
        self.full = full  # the answer to "is this bool mask all true?" (see `_answer`)
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return _answer(self, func, args[0])  # one mode, not two: every op pays for each mode
        flat_in, _ = tree_flatten((args, kwargs or {}))
        inputs = {id(s) for t in flat_in if isinstance(t, torch.Tensor) and (s := _storage_of(t)) is not None}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _storage_of(t)
                if st is not None and id(st) not in inputs and st.nbytes() > self.largest[0]:
                    where = self.module_stack[-1] if self.module_stack else ""
                    self.largest = (int(st.nbytes()), str(func), tuple(t.shape), where)
        return out


_VALUE_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default)


def _answer(mode: Any, func: Any, t: torch.Tensor) -> bool:
    """The one value a forward pass reads from a meta tensor: whether a bool is all true.

    transformers asks `attention_mask.all()` to skip building a mask when nothing is padded, and
    the prefix runner asks the same of its batch; the answer follows from the lengths, which the
    simulation knows (`mode.full`). Any other read of a value is an error naming the op.
    """
    if t.dtype == torch.bool:
        mode.answered += 1
        return mode.full
    raise SimulationError(f"the simulated pass reads a {t.dtype} value from a meta tensor ({func})")


_SDPA_LOCK = threading.Lock()


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Scaled-dot-product attention on meta tensors as the fused kernel runs it (no L x L scores)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    with _SDPA_LOCK:
        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _module_names(tracker: SimTracker, modules: tuple[torch.nn.Module, ...]) -> Iterator[None]:
    """Record the qualified name of the module running, for naming the largest allocation."""
    names = {id(m): n for root in modules for n, m in root.named_modules() if n}
    stack = tracker.module_stack

    def pre(mod: torch.nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), stack[-1] if stack else ""))

    def post(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def measure_meta(run: Callable[[], Any], modules: tuple[torch.nn.Module, ...], *, full: bool) -> tuple[int, tuple]:
    """Peak bytes above the start of `run()` on meta tensors, and the largest allocation in it."""
    tracker = SimTracker(full=full)  # also answers the mask reads (`_answer`)
    with torch.inference_mode(), _fused_attention(), _module_names(tracker, modules):
        with tracker.window("simulate") as w:
            run()
    return w.peak_increase, tracker.largest


# -- one pass per scorer family, on meta tensors -------------------------------------------------

def _rows(batch: int, length: int, padded: bool, fill: int = 5) -> list[list[int]]:
    """Token-id rows of the rectangle; padded: the last row one token short (so padding exists)."""
    rows = [[fill] * length for _ in range(batch)]
    if padded and batch > 1 and length > 1:
        rows[-1] = rows[-1][:-1]
    return rows


def _encoder_pass(model: str, mods: tuple, rows: list[list[int]], pair: bool) -> Callable[[], Any]:
    from rewardstack.scorers import classifier, embedding, encoding as enc

    m = mods[0]
    head = {"rlhf_reward_model": classifier._first_logit, "nsfw_filter": classifier._hate_value}.get(model, embedding._pooled)
    types = [[0] * len(r) for r in rows] if pair else None

    def run() -> Any:
        batch = _to_meta(enc.pad_batch(m, rows, 0, types))  # as `encoding.run_rows` builds a pass
        return head(m(**batch), batch["attention_mask"]).float()

    return run


def _to_meta(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # pad_batch builds ids on the host and moves them to the model's device (meta here).
    return {k: v.to("meta") for k, v in batch.items()}


def _prefix_runner(body: torch.nn.Module, prefix: int, fill: int = 5) -> Any:
    from rewardstack.scorers.prefix import PrefixRunner

    return PrefixRunner(body, [fill] * prefix, pad_id=0)


def _reciprocate_pass(mods: tuple, rows: list[list[int]], prefix: int) -> Callable[[], Any]:
    model = mods[0]
    body, head = model.base_model, model.score

    def run() -> Any:
        runner = _prefix_runner(body, prefix)
        h, _ = runner.run([r[runner.length:] for r in rows])  # ReciprocateScorer._forward
        idx = torch.arange(len(rows), device="meta")
        pos = torch.tensor([len(r) - 1 for r in rows]).to("meta")
        out = head(runner.rows(h, idx, pos))[:, 0].float()
        return runner, out

    return run


def _dahoas_pass(mods: tuple, rows: list[list[int]], prefix: int) -> Callable[[], Any]:
    body, head = mods

    def run() -> Any:
        runner = _prefix_runner(body, prefix)
        h, _ = runner.run([r[runner.length:] for r in rows])  # DahoasScorer._forward
        last = torch.tensor([len(r) - 1 for r in rows]).to("meta")
        out = head(runner.rows(h, torch.arange(len(rows), device="meta"), last))[:, 0].float()
        return runner, out

    return run


def _meta_logit_head(lm_head: torch.nn.Module, scale: float) -> Any:
    """`dpo.LogitHead` without its weight-norm bound (which reads values): same `__call__`."""
    from rewardstack.scorers.dpo import LogitHead

    head = object.__new__(LogitHead)
    head.weight = lm_head.weight
    head.bias = getattr(lm_head, "bias", None)
    head.scale = float(scale)
    head.vocab = int(lm_head.weight.shape[0])
    head.dtype = lm_head.weight.dtype
    head._wmax, head._bmax = 1.0, 0.0
    return head


def _penalty_pass(hidden_at: Callable, head: Any, b: int, lengths: list[int], plens: list[int], chunk: int) -> None:
    """`dpo.chunked_logprobs` transcribed op by op on meta tensors, sizes that need values bounded.

    Kept in step with dpo.py by tests/test_simulate.py (simulated vs tracked peak on a stand-in).
    """
    dev, long = "meta", torch.long
    vocab = head.vocab
    counts_l = [n - p for n, p in zip(lengths, plens)]
    total = sum(counts_l)
    ids = torch.empty(b, max(lengths), dtype=long, device=dev)
    prompt_lens = torch.empty(b, dtype=long, device=dev)
    lens = torch.empty(b, dtype=long, device=dev)
    counts = lens - prompt_lens
    seq = torch.empty(total, dtype=long, device=dev)  # repeat_interleave(arange(b), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = prompt_lens[seq] - 1 + (torch.arange(total, device=dev) - starts[seq])
    target = ids[seq, pos + 1]
    src = torch.where(pos - 1 >= prompt_lens[seq], ids[seq, (pos - 1).clamp(min=0)], -1)
    seen = torch.zeros(b, vocab, dtype=torch.int32, device=dev)
    penalty = torch.tensor(1.2, dtype=torch.float32, device=dev)
    dtype = head.dtype
    narrow = dtype != torch.float32
    sums = torch.zeros(b, dtype=torch.float32, device=dev)
    buf = torch.empty(min(chunk, total), vocab, dtype=torch.float32, device=dev)
    seq_of = [s for s, c in enumerate(counts_l) for _ in range(c)]
    starts_l = [sum(counts_l[:s]) for s in range(b)]
    done = [0] * b  # scored rows per sequence before the chunk
    for c0 in range(0, total, chunk):
        c1 = min(total, c0 + chunk)
        r = c1 - c0
        s_seq, s_src = seq[c0:c1], src[c0:c1]
        logits = buf[:r]
        h = hidden_at(s_seq, pos[c0:c1])
        head(h, logits)
        valid = s_src >= 0
        # Rows whose source token is counted (pos - 1 >= P): all but each sequence's first two.
        nvalid = sum(1 for k in range(c0, c1) if k - starts_l[seq_of[k]] >= 2)
        v_idx = torch.empty(nvalid, dtype=long, device=dev)  # s_src[valid] / s_seq[valid]
        in_chunk = sorted(set(seq_of[c0:c1]))
        uniq = torch.empty(len(in_chunk), dtype=long, device=dev)  # unique_consecutive(s_seq)
        mark = (seen[uniq] > 0).any(0)
        mark[v_idx] = True
        for s in seq_of[c0:c1]:
            done[s] += 1
        # Columns the chunk penalizes: at most one per token seen so far (every token distinct).
        ncols = min(vocab, sum(max(0, done[s] - 1) for s in in_chunk))
        cols = torch.empty(ncols, 1, dtype=long, device=dev).squeeze(1)  # mark.nonzero()
        hf = h.float()  # head.bound(h)
        norms = hf.norm(dim=1)
        del hf, norms
        bounded = ncols < vocab
        if ncols:
            onehot = (s_src.unsqueeze(1) == cols.unsqueeze(0)).to(torch.int32)
            csum = torch.cat([onehot.new_zeros(1, ncols), onehot.cumsum(0)])
            seg0 = (starts[s_seq] - c0).clamp(min=0)
            cnt = csum[1:] - csum[seg0] + seen[s_seq.unsqueeze(1), cols.unsqueeze(0)]
            idx = cols.unsqueeze(0).expand(r, -1)
            x = logits.gather(1, idx)
            f = torch.pow(penalty, cnt.float())
            pen = torch.where(cnt > 0, torch.where(x < 0, x * f, x / f), x)
            if narrow:
                pen = pen.to(dtype).float()
            logits.scatter_(1, idx, pen)
            seen.index_put_((s_seq[:nvalid].clone(), v_idx), torch.ones_like(v_idx, dtype=torch.int32), accumulate=True)
            del onehot, csum, seg0, cnt, idx, x, f, pen
        tgt = logits.gather(1, target[c0:c1].unsqueeze(1)).squeeze(1)
        if bounded:
            lse = logits.exp_().sum(1).log_()
        else:
            m = logits.amax(1, keepdim=True)
            logits.sub_(m).exp_()
            lse = logits.sum(1).log_().add_(m.squeeze(1))
        lp = tgt - lse
        if narrow:
            lp = lp.to(dtype).float()
        sums.index_add_(0, s_seq, lp)
        del h, valid, v_idx, uniq, mark, cols, tgt, lse, lp
    (sums.to(dtype).float() / counts.float()).to(dtype).double()


def _dpo_pass(mods: tuple, rows: list[list[int]], prefix: int, prompt: int, chunk: int,
              block: int | None = None) -> Callable[[], Any]:
    from rewardstack.scorers.attention import ATTENTION_BLOCK, block_rows_of
    from rewardstack.scorers.dpo import logits_scale

    model = mods[0]
    shared = block_rows_of(model)
    if shared is not None:  # blocked attention: the scorer's query rows per block
        shared.rows = int(block or ATTENTION_BLOCK)
    body, lm_head = model.base_model, model.get_output_embeddings()
    head = _meta_logit_head(lm_head, logits_scale(model))
    lengths = [len(r) for r in rows]
    plens = [max(1, min(prompt, n - 1)) for n in lengths]

    def run() -> Any:
        runner = _prefix_runner(body, prefix)  # DpoScorer._forward
        h, _ = runner.run([r[runner.length:] for r in rows])
        hidden_at = lambda s, p: runner.rows(h, s, p)  # noqa: E731
        _penalty_pass(hidden_at, head, len(rows), lengths, plens, chunk)
        return runner

    return run


def _judge_pass(mods: tuple, rows: list[list[int]], new_tokens: int = 2) -> Callable[[], Any]:
    from transformers import DynamicCache

    from rewardstack.scorers.prefix import _cache_kwarg

    model = mods[0]
    b, width = len(rows), max(len(r) for r in rows)

    def run() -> Any:
        # JudgeScorer.generate: left-padded ids and mask, moved to the device.
        ids = torch.empty(b, width, dtype=torch.long).to("meta")
        mask = torch.empty(b, width, dtype=torch.long).to("meta")
        cache = DynamicCache()
        out_ids = ids
        for step in range(new_tokens):  # transformers' greedy loop, modelled
            pos = mask.long().cumsum(-1) - 1
            pos = pos.masked_fill(mask == 0, 1)
            step_ids = out_ids if step == 0 else out_ids[:, -1:]
            step_pos = pos if step == 0 else pos[:, -1:]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                        logits_to_keep=1, **{_cache_kwarg(model): cache})
            logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            nxt = torch.argmax(logits, dim=-1)
            del out, logits
            out_ids = torch.cat([out_ids, nxt[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((b, 1))], dim=-1)
        return cache, out_ids

    return run


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
    import hashlib

    import transformers

    from rewardstack import standin_btlm
    from rewardstack.scorers import attention, classifier, dpo, dpo_numerics, embedding, encoding, prefix

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for mod in (__import__(__name__, fromlist=["_"]), attention, classifier, dpo, dpo_numerics, embedding, encoding, prefix):
        h.update(Path(mod.__file__).read_bytes())
    for f in sorted(Path(standin_btlm.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _disk_file(arch: Arch, dtype: str) -> Path:
    import hashlib

    assert _DISK is not None
    return _DISK / f"{arch.name}-{dtype}-{hashlib.sha256(arch.key().encode()).hexdigest()[:12]}.json"


def _disk_get(arch: Arch, dtype: str, key: tuple) -> SimResult | None:
    if _DISK is None:
        return None
    try:
        data = json.loads(_disk_file(arch, dtype).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("code") != _code_version():
        return None
    hit = data.get("results", {}).get(repr(key))
    if hit is None:
        return None
    hit["largest_alloc_shape"] = tuple(hit["largest_alloc_shape"])
    hit["modelled"] = tuple(hit["modelled"])
    return SimResult(**hit)


def _disk_put(arch: Arch, dtype: str, key: tuple, res: SimResult) -> None:
    if _DISK is None:
        return
    path = _disk_file(arch, dtype)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("code") != _code_version():
            data = {}
    except (OSError, ValueError):
        data = {}
    data["code"] = _code_version()
    data.setdefault("results", {})[repr(key)] = dataclasses.asdict(res)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)  # atomic: a killed run leaves the old file
MODELLED = {
    "dpo_reward_model": ("penalty bookkeeping (columns bounded: every scored token distinct)",),
    "prompt_reward_model": ("generation (prefill with logits_to_keep=1, then one decode step per new token)",),
}


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
    if model not in SCORERS:
        raise SimulationError(f"unknown model {model!r}; expected one of: {', '.join(SCORERS)}")
    if batch < 1 or length < 1 or not 0 <= prefix < length:
        raise SimulationError(f"need batch >= 1, length >= 1 and 0 <= prefix < length (got {batch}, {length}, {prefix})")
    arch = arch or load_arch(model_path(model, config))
    dtype = dtype or model_dtype(model, config)
    if dtype not in DTYPES:
        raise SimulationError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kind = SCORERS[model][0]
    # Scorers that run the same architecture the same way share results (relevance [1], diversity).
    same = "pooled" if kind == "encoder" else model
    key = (same, arch.key(), dtype, batch, length, prefix if kind in ("reciprocate", "dahoas", "dpo") else 0,
           prompt if kind == "dpo" else 0, padded, chunk if kind == "dpo" else 0, exact) + ((block,) if block else ())
    if key not in _CACHE:
        found = _disk_get(arch, dtype, key)
        if found is not None:
            _CACHE[key] = found
    if key in _CACHE:
        hit = _CACHE[key]
        return hit if hit.model == model else dataclasses.replace(hit, model=model)
    t0 = time.perf_counter()
    if exact or depth(arch) <= 3:
        res = _simulate(model, kind, meta_modules(model, dtype, arch), batch, length, dtype, prefix, prompt, padded, chunk, arch.legacy_cache, block)
    else:
        n = depth(arch)
        two = _simulate(model, kind, meta_modules(model, dtype, arch, min(2, n)), batch, length, dtype, prefix, prompt, padded, chunk, arch.legacy_cache, block)
        res = _simulate(model, kind, meta_modules(model, dtype, arch, min(3, n)), batch, length, dtype, prefix, prompt, padded, chunk, arch.legacy_cache, block)
        if n > 3:
            res.peak_bytes = res.peak_bytes + (n - 3) * (res.peak_bytes - two.peak_bytes)
    res.weights_bytes = weights_bytes_of(meta_modules(model, dtype, arch))
    res.arch = arch.name
    res.seconds = time.perf_counter() - t0
    _CACHE[key] = res
    _disk_put(arch, dtype, key, res)
    return res


def _simulate(model: str, kind: str, mods: tuple, batch: int, length: int, dtype: str, prefix: int,
              prompt: int, padded: bool, chunk: int, legacy: bool = False, block: int | None = None) -> SimResult:
    from rewardstack.scorers.attention import attention_of

    rows = _rows(batch, length, padded)
    if kind in ("classifier", "encoder"):
        run = _encoder_pass(model, mods, rows, pair=model == "rlhf_reward_model")
    elif kind == "reciprocate":
        run = _reciprocate_pass(mods, rows, prefix)
    elif kind == "dahoas":
        run = _dahoas_pass(mods, rows, prefix)
    elif kind == "dpo":
        run = _dpo_pass(mods, rows, 0 if legacy else prefix, max(prompt, prefix), chunk, block)
    else:
        run = _judge_pass(mods, rows)
    full = not (padded and batch > 1 and length > 1)
    peak, (lbytes, lop, lshape, lmod) = measure_meta(run, mods, full=full)
    return SimResult(model, batch, length, dtype, prefix, int(peak), lbytes, lop, tuple(lshape), lmod,
                     modelled=MODELLED.get(model, ()), attention=attention_of(mods[0]))


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
    if model == "rlhf_reward_model":
        dtype = dtype or "float32"  # the reference loads it with no dtype
    return simulate_peak(model, 1, n_tokens, dtype, padded=False, config=config, exact=exact)


def length_for_allocation(model: str, target_bytes: int, *, lo: int = 2, hi: int = 65_536,
                          config: Any | None = None, dtype: str | None = None) -> tuple[int, SimResult]:
    """The shortest input whose reference call's largest single allocation reaches `target_bytes`."""
    if reference_need(model, hi, config=config, dtype=dtype).largest_alloc_bytes < target_bytes:
        raise SimulationError(f"{model}: no input up to {hi} tokens allocates {target_bytes} bytes at once")
    while lo < hi:
        mid = (lo + hi) // 2
        if reference_need(model, mid, config=config, dtype=dtype).largest_alloc_bytes >= target_bytes:
            hi = mid
        else:
            lo = mid + 1
    return lo, reference_need(model, lo, config=config, dtype=dtype)


def length_for_peak(model: str, budget_bytes: int, *, lo: int = 2, hi: int = 65_536,
                    config: Any | None = None, dtype: str | None = None) -> int:
    """The shortest input whose reference call's peak exceeds `budget_bytes` (it would OOM there)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if reference_need(model, mid, config=config, dtype=dtype).peak_bytes > budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return lo


def stack_weights(config: Any | None = None, dtype: str | None = None) -> dict[str, int]:
    """Weight bytes of every active model of a stack (a checkpoint two scorers share counted once,
    under the first), from the architectures alone."""
    from rewardstack.config import default_config

    cfg = config if config is not None else default_config()
    out: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for name in active_models(cfg):
        arch = load_arch(model_path(name, cfg))
        dt = dtype or model_dtype(name, cfg)
        key = (arch.key(), dt)
        out[name] = 0 if key in seen else weights_bytes_of(meta_modules(name, dt, arch))
        seen.add(key)
    return out


def active_models(config: Any) -> list[str]:
    """The neural models a stack runs, by scorer name (the relevance filter's two as [0] and [1])."""
    out: list[str] = []
    for name, mc in config.models.items():
        if not mc.active or name not in {n.split("[", 1)[0] for n in SCORERS}:
            continue
        out += [f"{name}[{k}]" for k in range(len(mc.paths))] if name == "relevance_filter" else [name]
    return out


def gib(n: float) -> str:
    """Bytes as GiB with two decimals, the way CUDA's OOM message prints them."""
    return f"{n / 1024**3:.2f} GiB"

