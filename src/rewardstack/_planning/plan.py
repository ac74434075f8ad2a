"""`rewardstack plan`: will this stack fit a card of this size? From the configs alone.

No weights are downloaded and no GPU is needed: every model is built on the meta device from its
architecture (hub ids map to the JSON files shipped in `configs/archs/`, local folders use their
config.json), its weights are counted, and its scorer's forward pass is simulated at full size
(`planning.simulate`). The budget and the placement are decided by the same code the stack runs
(`memory.budget.split_card`, `memory.placement.Placement`), so
the plan is what the stack would do on that card.

Per model: weights, the activation cost model fitted to simulated peaks (at full size), where it is
placed, the longest input it admits and that input's simulated peak, and the largest batch of
tokens at that length. For the host: the weights kept pinned there for swaps and those of the
models that run there. The verdict for the stack is exactly one of:
  - `fits`: every model resident, and every model's longest admitted input within the activation
    budget (times the safety margin);
  - `fits with swapping`: every longest input fits, but some models are swapped in per step or run
    on the host; the swap traffic per step (bytes moved onto the card in a steady-state step) is given;
  - `cannot fit`: some model's longest input does not fit the activation budget even alone (it
    would be cut below the model's bound), or a model that must run on the card is larger than the
    whole weight budget.
accelerate's `estimate-memory` counts weights only; this adds activations and the whole stack.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rewardstack.config import StackConfig
from rewardstack.errors import ConfigError
from rewardstack._planning import simulate as S
from rewardstack._memory.budget import split_card, usable_bytes, weights_bytes
from rewardstack._memory.costmodel import CostModel, largest
from rewardstack._memory.placement import Placement
from rewardstack._models import MODELS, owner_of, spec
from rewardstack._scorers.encoding import default_pass_tokens

VERDICTS = ("fits", "fits with swapping", "cannot fit")


@dataclass
class ModelPlan:
    """One model's figures on the planned card."""

    name: str
    path: str
    arch: str
    dtype: str
    weights_bytes: int  # 0 where it loads a checkpoint an earlier model loads (`shares`): counted there
    where: str = "resident"
    reason: str = ""
    bound: int = 0  # longest input the scorer admits (tokens)
    peak_at_bound: int = 0  # simulated activation peak of one input of `bound` tokens
    largest_alloc_bytes: int = 0
    largest_alloc_op: str = ""
    input_fits: bool = True
    longest_fitting: int = 0  # the longest single input within the activation budget (<= bound)
    max_batch_at_bound: int = 0  # largest batch of `bound`-token inputs within the budget (and the scorer's cap)
    max_batch_tokens: int = 0  # that batch in tokens
    cost: dict = field(default_factory=dict)  # fitted cost model (bytes = a + b*B*L + c*B*L^2 ...)
    cost_fit_error: float = 0.0
    stand_in: str = ""
    attention: str = ""  # the attention the plan simulates: blocked(rows), sdpa, eager or own
    shares: str = ""  # the model whose checkpoint (same architecture, dtype and scorer kind) this one loads


@dataclass
class StackPlan:
    """The whole stack on one card."""

    device_memory: int
    usable_bytes: int
    weights_bytes: int
    weights_budget: int | None
    activation_budget: int
    margin: float
    verdict: str
    swap_bytes_per_step: int
    models: list[ModelPlan]
    seconds: float = 0.0
    host_pinned_bytes: int = 0  # swapped models' weights, kept pinned on the host (`Placement.host_bytes`)
    host_pageable_bytes: int = 0  # models placed on the host, in pageable memory


def _shapes(bound: int) -> list[tuple[int, int]]:
    """The simulated (batch, length) grid a cost model is fitted to (up to the bound)."""
    q, h = max(8, bound // 4), max(16, bound // 2)
    return sorted({(1, q), (1, h), (1, bound), (2, h), (4, q), (2, bound)})


def _fit(name: str, cfg: StackConfig, dtype: str, arch: S.Arch, bound: int) -> tuple[CostModel, S.SimResult, list]:
    samples = []
    top = None
    for b, l in _shapes(bound):
        r = S.simulate_peak(name, b, l, dtype, config=cfg, arch=arch, exact=False, padded=b > 1)
        samples.append((b, l, r.peak_bytes))
        if (b, l) == (1, bound):
            top = r
    assert top is not None
    return CostModel().fit(samples), top, samples


def _checked_batch(name: str, cfg: StackConfig, dtype: str, arch: S.Arch, bound: int, limit: float,
                   cost: CostModel, samples: list) -> tuple[int, CostModel]:
    """The largest batch at the bound, simulated at the batch it admits (as vLLM profiles at the
    largest batched shape): a fit from small batches may extrapolate low, so the admitted shape is
    added to the fit until the simulation confirms it."""
    b = _max_batch(cost, bound, limit, scorer_max_batch(name, cfg, bound))
    for _ in range(6):
        if b == 0:
            return 0, cost
        r = S.simulate_peak(name, b, bound, dtype, config=cfg, arch=arch, exact=False)
        if r.peak_bytes <= limit:
            return b, cost
        samples.append((b, bound, r.peak_bytes))
        cost = CostModel().fit(samples)
        b = min(b - 1, _max_batch(cost, bound, limit, b))
    while b > 0 and S.simulate_peak(name, b, bound, dtype, config=cfg, arch=arch, exact=False).peak_bytes > limit:
        b //= 2
    return b, cost


def _count_weights(cfg: StackConfig, names: list[str], dtype: str | None
                   ) -> tuple[dict[str, ModelPlan], dict[str, tuple[torch.nn.Module, ...]], dict[str, S.Arch]]:
    """Each model's plan with its weights, its meta modules (one set per distinct checkpoint: shared
    ones are one object, counted once, for the first model that loads it), and the architectures."""
    first: dict[tuple, str] = {}  # checkpoint -> the first model that loads it
    plans: dict[str, ModelPlan] = {}
    modules: dict[str, tuple[torch.nn.Module, ...]] = {}
    archs: dict[str, S.Arch] = {}
    for name in names:
        path = S.model_path(name, cfg)
        arch = archs[name] = S.load_arch(path)
        dt = dtype or S.model_dtype(name, cfg)
        owner = first.setdefault((arch.key(), dt, spec(name).simulated.auto_class), name)
        mods = modules[name] = modules[owner] if owner != name else S.meta_modules(name, dt, arch)
        plans[name] = ModelPlan(name, path, arch.name, dt, weights_bytes(mods) if owner == name else 0,
                                stand_in=arch.stand_in, shares="" if owner == name else owner)
    return plans, modules, archs


def plan_weights(cfg: StackConfig, dtype: str | None = None) -> list[ModelPlan]:
    """The plan's weights per model (as `plan_stack` counts them), without simulating any pass."""
    return list(_count_weights(cfg, S.active_models(cfg), dtype)[0].values())


def plan_stack(cfg: StackConfig, device_memory: int, *, dtype: str | None = None) -> StackPlan:
    """Plan `cfg` on a card of `device_memory` bytes (dtype: override every model's dtype)."""
    t0 = time.perf_counter()
    names = S.active_models(cfg)
    plans, modules, archs = _count_weights(cfg, names, dtype)
    weights = sum(p.weights_bytes for p in plans.values())

    # The budget, as MemoryManager.setup decides it on a card of this size (the same split_card).
    usable = usable_bytes(device_memory, cfg)
    weights_budget, activation = split_card(usable, weights, cfg.memory_budget)

    # Placement, by the stack's own rules (scorer names; masks may run on the host).
    placement = Placement("cuda", weights_budget, move=False)
    owners: dict[str, list[torch.nn.Module]] = {}
    for name in names:
        owner = owner_of(name)
        owners.setdefault(owner, []).extend(m for m in modules[name] if all(m is not o for o in owners.get(owner, [])))
    for owner, mods in owners.items():
        placement.register(owner, mods, cpu_ok=owner in _MASKS)
    decisions = placement.plan()
    pinned, pageable = placement.host_bytes()
    swap = _swap_traffic(placement, list(owners))

    margin = cfg.safety_margin
    cannot = False
    for name in names:
        p = plans[name]
        d = decisions[owner_of(name)]
        p.where, p.reason = d.where, d.reason
        p.bound = S.scorer_bound(name, cfg, archs[name])
        cost, top, samples = _fit(name, cfg, p.dtype, archs[name], p.bound)
        p.peak_at_bound, p.largest_alloc_bytes, p.largest_alloc_op = top.peak_bytes, top.largest_alloc_bytes, top.largest_alloc_op
        p.attention = top.attention
        on_card = p.where != "cpu"
        limit = activation * margin
        p.input_fits = (not on_card) or top.peak_bytes <= limit
        p.longest_fitting = p.bound if p.input_fits else _longest_fitting(name, cfg, p.dtype, archs[name], p.bound, limit)
        if on_card and p.input_fits:
            p.max_batch_at_bound, cost = _checked_batch(name, cfg, p.dtype, archs[name], p.bound, limit, cost, samples)
            p.max_batch_tokens = p.max_batch_at_bound * p.bound
        p.cost, p.cost_fit_error = cost.to_dict(samples=False), cost.max_error()
        # An input of the bound over the budget, or a reward model larger than the card's whole weight budget.
        cannot = cannot or not p.input_fits or (p.where == "cpu" and owner_of(name) not in _MASKS)
    swapping = any(p.where != "resident" for p in plans.values())
    verdict = "cannot fit" if cannot else "fits with swapping" if swapping else "fits"
    return StackPlan(device_memory, usable, weights, weights_budget, int(activation), margin, verdict,
                     swap, list(plans.values()), time.perf_counter() - t0, pinned, pageable)


_MASKS = tuple(m.name for m in MODELS if not m.is_reward and not m.is_rule)  # may run on the CPU


def scorer_max_batch(name: str, cfg: StackConfig, bound: int) -> int:
    """The most inputs of `bound` tokens the scorer puts in one pass on a GPU, whatever the budget:
    `batch_size`, else the decoders' `max_batch` option, else the encoders' per-pass token cap
    (their `max_batch_tokens` option, else the scorers' default on an accelerator)."""
    mc = cfg.models[owner_of(name)]
    if mc.batch_size:
        return int(mc.batch_size)
    if spec(name).simulated.family in ("classifier", "encoder"):
        tokens = mc.options.max_batch_tokens or default_pass_tokens(bound, torch.device("cuda"))
        return max(1, tokens // bound)
    return mc.options.max_batch


def _longest_fitting(name: str, cfg: StackConfig, dtype: str, arch: S.Arch, bound: int, limit: float) -> int:
    """The longest single input whose simulated peak is within `limit` (bisection on the simulation)."""
    return largest(lambda n: S.simulate_peak(name, 1, n, dtype, config=cfg, arch=arch, exact=False,
                                             padded=False).peak_bytes <= limit, bound)


def _max_batch(cost: CostModel, length: int, limit: float, cap: int = 4096) -> int:
    """The largest batch of `length`-token inputs the cost model puts within `limit` (its predictions
    grow with the batch: every coefficient is non-negative)."""
    return largest(lambda b: cost.predict(b, length) <= limit, cap)


def _swap_traffic(placement: Placement, order: list[str]) -> int:
    """Bytes moved onto the card in a steady-state step (each model used once per step, in order)."""
    for n in order:  # the first step warms the LRU
        placement.ensure(n)
    moved = 0
    for n in order:
        s0 = placement.swaps
        placement.ensure(n)
        if placement.swaps > s0:
            moved += placement._models[n].size  # noqa: SLF001 - our own accounting
    return moved


# -- output ----------------------------------------------------------------------------------------

def _g(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.2f}"


def reasons(plan: StackPlan) -> list[str]:
    """One line per model that does not fit as planned (or runs on the host): why."""
    out: list[str] = []
    limit = plan.activation_budget * plan.margin
    for p in plan.models:
        if p.where == "cpu":
            base = owner_of(p.name)
            role = "a mask, it runs in host memory (slower, no device budget)" if base in _MASKS else \
                "a reward model must run on the card: cannot fit"
            out.append(f"{p.name}: on the host ({p.reason or 'the weight budget cannot hold it'}); {role}")
        elif not p.input_fits:
            out.append(f"{p.name}: one input of its bound ({p.bound} tokens) peaks at {_g(p.peak_at_bound)} GiB, over "
                       f"the activation budget {_g(plan.activation_budget)} GiB x margin {plan.margin:g} = "
                       f"{_g(limit)} GiB; inputs longer than {p.longest_fitting} tokens would be cut")
    return out


def format_plan(plan: StackPlan) -> str:
    """The table `rewardstack plan` prints."""
    lines = [
        f"card {_g(plan.device_memory)} GiB: usable {_g(plan.usable_bytes)} GiB, weights {_g(plan.weights_bytes)} GiB "
        f"(weight budget {'all resident' if plan.weights_budget is None else _g(plan.weights_budget) + ' GiB'}), "
        f"activation budget {_g(plan.activation_budget)} GiB x margin {plan.margin:g}",
        "",
        f"{'model':26s} {'dtype':8s} {'weights':>8s} {'where':9s} {'bound':>6s} {'peak@bound':>10s} "
        f"{'largest':>8s} {'fits':>5s} {'longest':>7s} {'batch@bound':>11s} {'tokens':>7s} {'attention':12s} cost model (B=batch, L=length)",
    ]
    for p in plan.models:
        c = p.cost or {k: 0.0 for k in "abcdef"}
        cm = f"{c['a'] / 2**20:.0f} MiB + {c['b'] / 2**10:.1f} KiB*B*L + {c['c']:.1f} B*B*L^2"
        extra = [f"{c['d'] / 2**20:.1f} MiB*B" if c["d"] else "", f"{c['e'] / 2**10:.1f} KiB*L" if c["e"] else "",
                 f"{c['f']:.1f} B*L^2" if c["f"] else ""]
        cm += "".join(" + " + x for x in extra if x)
        # Host-placed models have no device budget; no batch applies where no input fits the bound.
        fits, longest = ("host", "-") if p.where == "cpu" else ("yes" if p.input_fits else "no", str(p.longest_fitting))
        on_card = p.where != "cpu" and p.input_fits
        batch = f"{p.max_batch_at_bound:>11d} {p.max_batch_tokens:>7d}" if on_card else f"{'-':>11s} {'-':>7s}"
        lines.append(
            f"{p.name:26s} {p.dtype:8s} {'shared' if p.shares else _g(p.weights_bytes):>8s} {p.where:9s} {p.bound:>6d} {_g(p.peak_at_bound):>10s} "
            f"{_g(p.largest_alloc_bytes):>8s} {fits:>5s} {longest:>7s} {batch} "
            f"{p.attention or '-':12s} {cm}")
    lines.append("")
    lines.append("sizes in GiB; peak@bound: one input of the model's longest admitted length; largest: its largest "
                 "single allocation; batch@bound: inputs of that length per pass within the budget, at most "
                 "the scorer's own cap (batch_size, or 16); fits: whether an input of the model's bound fits the "
                 "activation budget (host: runs in host memory, no device budget); longest: the longest input in "
                 "tokens that fits (longer inputs are cut); attention: blocked(R) is exact attention in blocks of "
                 "R query rows (no L x L scores), own the model's code (L x L scores), sdpa torch's fused kernel")
    lines += [f"why: {r}" for r in reasons(plan)]
    for p in plan.models:
        if p.shares:
            lines.append(f"shared: {p.name} loads the checkpoint {p.shares} loads; its weights are counted once, there")
    stand = [p for p in plan.models if p.stand_in]
    for p in stand:
        lines.append(f"note: {p.name} ({p.arch}): {p.stand_in.split(' (')[0]}")
    lines.append(f"host memory: {_g(plan.host_pinned_bytes)} GiB pinned (the swapped models' weights, kept on the "
                 f"host for copies onto the card), {_g(plan.host_pageable_bytes)} GiB pageable (models run on the host)")
    tail = f"verdict: {plan.verdict}"
    if plan.swap_bytes_per_step:
        tail += f" (swapping moves {_g(plan.swap_bytes_per_step)} GiB onto the card per step)"
    lines.append(tail)
    return "\n".join(lines)


def cmd_plan(args: Any) -> int:
    """`rewardstack plan`: load the config (default: the shipped default stack), plan it on the card,
    print the table (and write --json). Simulated peaks are kept in the plan cache across runs (per
    architecture and dtype; `--no-cache`: none), so a second plan takes about a second."""
    from importlib import resources

    from rewardstack.config import build_config
    from rewardstack._modelflags import model_flags
    from rewardstack._paths import plan_cache
    from rewardstack._settings import parse_bytes

    size = parse_bytes(args.device_memory, key="--device-memory") if args.device_memory else None
    S.use_disk_cache(None if args.no_cache else plan_cache())
    flags = {**model_flags(args), "dtype": None}  # plan_stack applies --dtype to every model
    default = None if flags["reward_models"] else str(resources.files("rewardstack") / "configs" / "default.toml")
    cfg = build_config(args.config or default, **flags)
    size = size or cfg.memory.device_memory
    if size is None:
        raise ConfigError("--device-memory", "give the card's size (e.g. 40GiB) or set [memory] device_memory")
    plan = plan_stack(cfg, size, dtype=args.dtype)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(plan), f, indent=2)
            f.write("\n")
    print(format_plan(plan))
    print(f"planned in {plan.seconds:.1f} s")
    return 0
