"""The GPU check of the memory simulation: full-size models, random weights, a card of 40 GiB.

Run by scripts/gpu-check.sh when a GPU is lent (under 8 minutes on one card). The card may be far
larger than 40 GiB: `torch.cuda.set_per_process_memory_fraction` caps this process at
`--device-memory` (the `[memory] device_memory` setting's cap), so every figure is a 40 GiB card's.

1. Every active model of the default stack is built from its shipped architecture with random
   weights initialized on the GPU, in its configured dtype, and stays resident.
2. Per model, the scorer's pass at a few shapes (the longest admitted input included): the
   measured peak (torch.cuda.max_memory_allocated above the bytes live before) must be within
   15% of `simulate_peak`'s prediction. [FAIL] otherwise.
3. A heavy-tailed workload (tests/soak/synthetic.py's heavy_tailed_lengths, in tokens) is planned per model with
   the cost model fitted to simulated peaks against the activation budget left on the card, and
   every planned batch runs: zero OOM. [FAIL] on any OOM.
4. The unbounded reference OpenAssistant call (DeBERTa-v3-large, float32, batch 1): the
   simulation picks the shortest input whose peak exceeds what the card has left; that input
   must OOM, and one at 90% of that length must not. [FAIL] otherwise.
5. Swaps that complete: the stack's models under a weights budget that holds only some of them;
   `Placement` swaps each in and out; every swap must leave exactly the planned bytes on the card
   (allocator-measured within 5%) and the swapped-in model must score. [FAIL] otherwise.
6. Recovery from a real CUDA OOM: a batch of DeBERTa reference inputs that the simulation says
   cannot fit together runs through the OOM guard; it must OOM for real, split, and give every
   input the value it has when run alone (nothing lost). [FAIL] otherwise.
7. DPO on the full-size BTLM (blocked attention, installed after its probe on the card) at
   8,192 tokens: no OOM, measured peak within 10% of the simulated one.
8. The swap time of the largest model swapped on a 24 GiB card: pageable `.to()`, pinned copies on
   a side stream (`rewardstack._memory.pinned.PinnedSwapper`, what placement swaps with on a card),
   and that copy overlapped with a DPO pass.

Each phase prints its figures as it ends; with $OUT set they are also appended, one JSON object
a line, to $OUT/gpu-check.jsonl (flushed and synced), so a timeout keeps what was measured.

`--dry-run` runs every CPU part (simulations, the plan of batches, the OOM length) and prints
what it would measure, without a GPU (tests/test_plan.py runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from typing import Any

import torch

from rewardstack.config import default_config
from rewardstack._planning import simulate as S
from rewardstack._memory.budget import weights_bytes
from rewardstack._models import resolve, spec
from rewardstack._memory.costmodel import CostModel, plan_batches
from rewardstack._planning.plan import plan_weights, scorer_max_batch
from rewardstack._settings import parse_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: the tests' workload
from tests.soak.synthetic import heavy_tailed_lengths  # noqa: E402

GIB = 1024**3
TOLERANCE = 0.15
SWAP_TOLERANCE = 0.05
failures: list[str] = []
# Modules the check imports inside its functions: scripts/gpu_preflight.py imports them up front,
# so a package the card's image lacks is named before any GPU time is spent.
LAZY_MODULES = [
    "rewardstack._scorers.classifier", "rewardstack._scorers.embedding", "rewardstack._scorers.encoding",
    "rewardstack._scorers.dpo", "rewardstack._scorers.prefix", "rewardstack._memory.guard",
    "rewardstack._memory.placement", "rewardstack._memory.budget", "rewardstack._memory.device",
    "rewardstack._scorers.attention", "rewardstack._memory.pinned", "transformers",
]


def record(phase: str, **figures: Any) -> None:
    """Append one phase's figures to $OUT/gpu-check.jsonl (when $OUT is set), synced at once: a
    check stopped by its timeout still leaves every figure measured before it."""
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu-check.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"phase": phase, "time": round(time.time(), 3), **figures}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def check(ok: bool, what: str, phase: str = "check") -> None:
    """Print a figure's verdict; remember failures (the script exits 1 on any)."""
    print(("  [ok]   " if ok else "  [FAIL] ") + what, flush=True)
    record(phase, ok=ok, what=what)
    if not ok:
        failures.append(what)


def phase_done(phase: str, started: float, **figures: Any) -> None:
    """The line that ends a phase, with its wall time; recorded with its figures."""
    took = time.time() - started
    print(f"phase {phase}: done in {took:.1f}s", flush=True)
    record(phase, seconds=round(took, 2), done=True, **figures)


def build_on_gpu(model: str, arch: S.Arch, dtype: str) -> tuple[torch.nn.Module, ...]:  # pragma: no cover - CUDA-only path
    """Full-size modules with random weights, initialized on the GPU in `dtype`."""
    import transformers

    torch.manual_seed(0)
    conf = arch.config()
    dt = S.DTYPES[dtype]
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dt)  # initialized in its dtype: no float32 copy of a 6B model first
    try:
        with torch.device("cuda"):
            if S.SCORERS[model][1] == "GPTJModel":
                mods: tuple = (transformers.GPTJModel(conf), torch.nn.Linear(conf.n_embd, 1, bias=False))
            elif arch.remote_code:
                mods = (arch.remote_class(S.SCORERS[model][1])(conf),)
            else:
                mods = (getattr(transformers, S.SCORERS[model][1]).from_config(conf, dtype=dt),)
    finally:
        torch.set_default_dtype(saved)
    mods = tuple(m.to(dt) for m in mods)
    for m in mods:
        m.eval().requires_grad_(False)
    return planned_attention(model, arch, mods)


def planned_attention(model: str, arch: S.Arch, mods: tuple) -> tuple:
    """The DPO scorer's load-time attention on a remote-code model: blocked when its probe agrees
    (the probe runs here, on the card), as `DpoScorer` installs it and the simulation plans it."""
    if arch.remote_code and S.SCORERS[model][0] == "dpo":
        from rewardstack._scorers import attention

        choice = attention.install(model, mods[0].base_model)
        print(f"  {model}: {choice.describe()} ({choice.reason})", flush=True)
    return mods


def scorer_pass(model: str, mods: tuple, batch: int, length: int, prefix: int, device: str, chunk: int = 512) -> None:
    """The scorer's pass on real tensors (random ids, last row one token short), as the simulation
    runs it. tests/test_simulate.py runs it on CPU under the tracker against the simulation."""
    from rewardstack._scorers import encoding as enc
    from rewardstack._scorers.dpo import LogitHead, chunked_logprobs, logits_scale
    from rewardstack._scorers.prefix import PrefixRunner

    m = mods[0]
    vocab = getattr(m.config, "vocab_size", 30000)
    plen = max(1, prefix)  # DPO: rows after the prompt are scored (the simulation's `prompt`)
    if S.SCORERS[model][0] == "dpo" and getattr(m.config, "model_type", "") == "btlm":
        prefix = 0  # tuple-cache remote code: the DPO scorer runs full sequences (as simulate does)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(5, vocab, (length,), generator=g).tolist() for _ in range(batch)]
    for r in rows:
        r[:prefix] = rows[0][:prefix]
    if batch > 1:
        rows[-1] = rows[-1][:-1]
    kind = S.SCORERS[model][0]
    if kind in ("classifier", "encoder"):
        head = resolve(spec(model).simulated.head)  # the scorer's own head (the model registry names it)
        types = [[0] * len(r) for r in rows] if spec(model).pair_input else None
        b = enc.pad_batch(m, rows, 0, types)
        head(m(**b), b["attention_mask"]).float()
    elif kind in ("reciprocate", "dahoas"):
        body, head = (m.base_model, m.score) if kind == "reciprocate" else mods
        runner = PrefixRunner(body, rows[0][:prefix], pad_id=0)
        h, _ = runner.run([r[prefix:] for r in rows])
        head(runner.rows(h, torch.arange(batch, device=device), torch.tensor([len(r) - 1 for r in rows], device=device)))
    elif kind == "dpo":
        lh = LogitHead(m.get_output_embeddings(), logits_scale(m))
        runner = PrefixRunner(m.base_model, rows[0][:prefix], pad_id=0)
        h, _ = runner.run([r[prefix:] for r in rows])
        n = torch.tensor([len(r) for r in rows], device=device)
        ids = torch.zeros(batch, length, dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, : len(r)] = torch.tensor(r)
        chunked_logprobs(lambda s, p: runner.rows(h, s, p), lh, ids.to(device), torch.full((batch,), plen, device=device), n, chunk)
    else:
        width = max(len(r) for r in rows)
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, width - len(r):] = torch.tensor(r)
            mask[k, width - len(r):] = 1
        m.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=2, do_sample=False, pad_token_id=0)


def measured_peak(fn: Any) -> int:  # pragma: no cover - CUDA-only path
    torch.cuda.synchronize()
    gc.collect()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - start)


def shapes_for(model: str, bound: int) -> list[tuple[int, int, int]]:
    """(batch, length, prefix) per model: a short batch, a long one, the longest admitted input."""
    kind = S.SCORERS[model][0]
    pre = bound // 4 if kind in ("reciprocate", "dahoas", "dpo") else 0
    return [(8, max(16, bound // 8), 0), (2, bound // 2, pre), (1, bound, pre)]


def fitted_cost(model: str, bound: int, dtype: str, cap: int) -> CostModel:
    """The cost model fitted to simulated peaks, up to the scorer's largest pass (`cap` x `bound`)."""
    from rewardstack._planning.plan import _shapes

    shapes = sorted(set(_shapes(bound)) | {(cap, bound), (cap, max(8, bound // 4))})
    samples = [(b, l, S.simulate_peak(model, b, l, dtype, exact=False, padded=b > 1).peak_bytes) for b, l in shapes]
    return CostModel().fit(samples)


def swap_phase(names: list[str], mods: dict[str, tuple], weights: int, dry: bool) -> None:
    """5. Swaps that complete: a weights budget that holds the largest model and half the rest, so
    some models swap; each swap must leave the planned bytes on the card and the model must score."""
    from rewardstack._memory.placement import Placement

    t = time.time()
    sizes = {n: weights_bytes(mods[n]) for n in names}
    largest = max(sizes.values())
    budget = largest + max(0, weights - largest) // 2
    device = "cpu" if dry else "cuda"
    residue = 0 if dry else torch.cuda.memory_allocated() - weights  # pragma: no branch
    placement = Placement(device, budget, move=not dry)
    for n in names:
        placement.register(n, list(mods[n]))
    decisions = placement.plan()
    swapped = [n for n, d in decisions.items() if d.where == "swap"]
    print(f"swaps: weights budget {budget / GIB:.2f} GiB of {weights / GIB:.2f} GiB; swapped on demand: "
          f"{', '.join(swapped) or 'none'}", flush=True)
    times: list[float] = []
    if not dry:  # pragma: no cover - CUDA-only path
        for n in swapped * 2:  # twice round: every swap evicts another swapped model
            torch.cuda.synchronize()
            s0 = time.time()
            placement.ensure(n)
            torch.cuda.synchronize()
            took = time.time() - s0
            times.append(took)
            planned = placement.device_bytes() + residue
            allocated = torch.cuda.memory_allocated()
            err = (allocated - planned) / max(planned, 1)
            try:
                with torch.inference_mode():
                    scorer_pass(n, mods[n], 1, 64, 0, "cuda")
                scored = "scored"
            except Exception as exc:  # noqa: BLE001 - a failed pass after a swap is the finding
                scored = f"failed to score: {type(exc).__name__}: {exc}"
            check(abs(err) <= SWAP_TOLERANCE and scored == "scored",
                  f"swap in {n} ({sizes[n] / GIB:.2f} GiB) in {took:.2f}s ({sizes[n] / GIB / max(took, 1e-9):.1f} GiB/s): "
                  f"allocated {allocated / GIB:.2f} GiB vs planned {planned / GIB:.2f} GiB ({err:+.1%}), {scored}", "swaps")
        check(bool(swapped), f"the budget forced swaps ({len(swapped)} models)", "swaps")
        placement.budget_bytes = None  # every model resident again for the phases after this one
        placement.plan()
    phase_done("5 swaps", t, swapped=swapped, budget=budget, swap_seconds=[round(x, 3) for x in times])


def reference_deberta(mods: dict[str, tuple], cfg: Any) -> tuple:  # pragma: no cover - CUDA-only path
    """The OpenAssistant DeBERTa as the reference ran it, in float32: the stack's own modules when
    the stack runs it in float32 (the default), else a float32 build of its architecture."""
    if S.model_dtype("rlhf_reward_model", cfg) == "float32":
        return mods["rlhf_reward_model"]
    return build_on_gpu("rlhf_reward_model", S.load_arch(S.model_path("rlhf_reward_model", cfg)), "float32")


def length_for_peak(model: str, budget_bytes: int, *, lo: int = 2, hi: int = 65_536) -> int:
    """The shortest input whose reference call's peak exceeds `budget_bytes` (it would OOM there)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if S.reference_need(model, mid).peak_bytes > budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return lo


def oom_recovery_phase(mods: dict[str, tuple], cfg: Any, card: int, live: int, dry: bool) -> None:
    """6. A real CUDA OOM survived with nothing lost: four DeBERTa reference inputs, each simulated
    at 45% of what the card has left, in one batch; the guard must hit a real OOM, split, and give
    each input the value it has alone."""
    from rewardstack._memory.guard import OomRecord, run_guarded
    from rewardstack._scorers import classifier, encoding as enc

    t = time.time()
    left = card - (live if dry else torch.cuda.memory_allocated())
    length = length_for_peak("rlhf_reward_model", int(left * 0.45))
    print(f"OOM recovery: 4 x {length} tokens in one batch, each simulated at 45% of the {left / GIB:.2f} GiB left", flush=True)
    if dry:
        phase_done("6 oom recovery", t, length=length)
        return
    deberta = reference_deberta(mods, cfg)  # pragma: no cover - CUDA-only path
    m = deberta[0]
    g = torch.Generator().manual_seed(6)
    rows = [torch.randint(5, m.config.vocab_size, (length,), generator=g).tolist() for _ in range(4)]

    def forward(idx: list[int]) -> list[float]:
        b = enc.pad_batch(m, [rows[i] for i in idx], 0, [[0] * length for _ in idx])
        with torch.inference_mode():
            return classifier.first_logit(m(**b), b["attention_mask"]).float().tolist()

    ooms: list[OomRecord] = []
    got = run_guarded("rlhf_reward_model", [[0, 1, 2, 3]], [length] * 4, forward, device=torch.device("cuda"),
                      fallback=None, on_oom=ooms.append)
    alone = [forward([i])[0] for i in range(4)]
    real = [r for r in ooms if not r.injected]
    values_ok = all(got[i].status == "ok" and abs(got[i].value - alone[i]) <= 1e-3 * max(1.0, abs(alone[i])) for i in range(4))
    check(bool(real) and values_ok,
          f"real OOMs {len(real)} ({', '.join(r.action for r in real)}); statuses {[got[i].status for i in range(4)]}; "
          f"values equal to each input alone: {values_ok}", "oom recovery")
    phase_done("6 oom recovery", t, length=length, ooms=len(real), values_ok=values_ok)


BTLM_TOLERANCE = 0.10  # issue 19: DPO on full-size BTLM at 8,192 tokens, measured within 10% of simulated


def check_btlm_at_bound(names: list[str], mods: dict[str, tuple], cfg: Any, dry: bool) -> None:
    """7. DPO on the full-size BTLM (random weights from its architecture, blocked attention) at its
    8,192-token bound, batch 1, under the card's cap: no OOM, peak within 10% of the simulation."""
    n = "dpo_reward_model"
    if n not in names:
        return
    bound = S.scorer_bound(n, cfg)
    sim = S.simulate_peak(n, 1, bound, padded=False, exact=False)
    print(f"DPO on full-size BTLM at {bound} tokens ({sim.attention}): simulated {sim.peak_bytes / GIB:.3f} GiB, "
          f"largest {sim.largest_alloc_bytes / GIB:.3f} GiB {sim.largest_alloc_op}", flush=True)
    if dry:
        print("  (would measure)")
        return
    try:  # pragma: no cover - CUDA-only path
        real = measured_peak(lambda: scorer_pass(n, mods[n], 1, bound, 0, "cuda"))
    except torch.OutOfMemoryError:  # pragma: no cover
        check(False, f"{n} at {bound} tokens: OOM (simulated {sim.peak_bytes / GIB:.3f} GiB)", "btlm at bound")
        return
    err = (real - sim.peak_bytes) / max(sim.peak_bytes, 1)  # pragma: no cover
    check(abs(err) <= BTLM_TOLERANCE, f"{n} at {bound} tokens: measured {real / GIB:.3f} GiB, simulated "
          f"{sim.peak_bytes / GIB:.3f} GiB ({err:+.1%}, tolerance {BTLM_TOLERANCE:.0%}), no OOM", "btlm at bound")


def largest_swapped(cfg: Any, card: int) -> tuple[str, int] | None:
    """The largest model `rewardstack plan` swaps on a card of `card` bytes (None: nothing swapped)."""
    from rewardstack._memory.budget import split_card
    from rewardstack._memory.placement import Placement

    names = S.active_models(cfg)
    owners: dict[str, list] = {}
    for n in names:
        arch, dt = S.load_arch(S.model_path(n, cfg)), S.model_dtype(n, cfg)
        owners.setdefault(n.split("[", 1)[0], []).extend(S.meta_modules(n, dt, arch))
    weights = sum(p.weights_bytes for p in plan_weights(cfg))
    wb, _ = split_card(int(card * cfg.gpu_utilization) - cfg.headroom_bytes, weights, cfg.memory_budget)
    placement = Placement("cuda", wb, move=False)
    for owner, ms in owners.items():
        placement.register(owner, list({id(m): m for m in ms}.values()), cpu_ok=owner in ("relevance_filter", "diversity_reward_model", "nsfw_filter"))
    swapped = [(name, d.bytes) for name, d in placement.plan().items() if d.where == "swap"]
    return max(swapped, key=lambda x: x[1]) if swapped else None


def check_swap_time(cfg: Any, mods: dict[str, tuple], dry: bool, card: int = 24 * GIB) -> None:
    """8. Swap time of the largest model swapped on a 24 GiB card: plain `.to()` from pageable host
    memory, then from pinned copies on the copy stream (`PinnedSwapper`) alone and overlapped
    with a DPO pass (wall time of both against the pass alone)."""
    found = largest_swapped(cfg, card)
    if found is None:
        print("swap time: nothing is swapped on a 24 GiB card")
        return
    name, size = found
    print(f"swap time of {name} ({size / GIB:.2f} GiB, the largest swapped on a {card / GIB:.0f} GiB card):", flush=True)
    if dry or name not in {n.split('[', 1)[0] for n in mods}:
        print("  (would measure: pageable .to(), pinned copy on a side stream, and that copy overlapped with a DPO pass)")
        return
    from rewardstack._memory.pinned import PinnedSwapper

    ms = next(v for k, v in mods.items() if k.split("[", 1)[0] == name)  # pragma: no cover
    sw = PinnedSwapper(torch.device("cuda"))  # pragma: no cover

    def timed_cuda(fn: Any) -> float:  # pragma: no cover
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for m in ms:  # pragma: no cover
        m.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    plain = timed_cuda(lambda: [m.to("cuda") for m in ms])  # pragma: no cover
    for m in ms:  # pragma: no cover
        m.to("cpu")
        sw.pin(m)
    torch.cuda.empty_cache()
    pinned = timed_cuda(lambda: [sw.to_device(m) for m in ms])  # pragma: no cover
    for m in ms:  # pragma: no cover
        sw.to_host(m)
    torch.cuda.empty_cache()
    dpo = "dpo_reward_model"
    if dpo in mods:  # pragma: no cover
        def compute() -> None:
            with torch.inference_mode():
                scorer_pass(dpo, mods[dpo], 1, 4096, 0, "cuda")
        alone = timed_cuda(compute)

        def both() -> None:
            for m in ms:
                sw.to_device(m, wait=False)
            compute()
            for m in ms:
                sw.ready(m)
        overlapped = timed_cuda(both)
        print(f"  DPO pass (1 x 4096) alone {alone:.3f} s; with the copy overlapped {overlapped:.3f} s "
              f"(sequential would be {alone + pinned:.3f} s)")
    for m in ms:  # pragma: no cover
        sw.ready(m)
    print(f"  pageable .to(): {plain:.3f} s ({size / plain / 1e9:.1f} GB/s); pinned, side stream: {pinned:.3f} s "
          f"({size / pinned / 1e9:.1f} GB/s)", flush=True)
    check(pinned <= plain, f"{name}: pinned swap-in {pinned:.3f} s <= pageable {plain:.3f} s", "swap time")  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-memory", default="40GiB")
    ap.add_argument("--dry-run", action="store_true", help="CPU parts only: simulate and plan, measure nothing")
    ap.add_argument("--models", default="", help="comma-separated subset of the stack's models")
    ap.add_argument("--completions", type=int, default=50)
    args = ap.parse_args(argv)
    card = parse_bytes(args.device_memory, key="--device-memory")
    cfg = default_config()
    names = [n for n in S.active_models(cfg) if not args.models or n in args.models.split(",")]
    dry = args.dry_run
    if not dry:  # pragma: no cover - CUDA-only path
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
            print(f"needs a GPU: torch {torch.__version__} ({build}) sees no CUDA device; "
                  "--dry-run runs the CPU parts", flush=True)
            return 2
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, card / total))
        print(f"device: {torch.cuda.get_device_name()} ({total / GIB:.1f} GiB), capped at {card / GIB:.2f} GiB", flush=True)
        record("device", name=torch.cuda.get_device_name(), total=total, cap=card, torch=torch.__version__)
    t0 = time.time()

    # 1. the stack's models, resident
    t = time.time()
    mods: dict[str, tuple] = {}
    shared: dict[tuple, tuple] = {}
    weights = 0
    for n in names:
        arch, dt = S.load_arch(S.model_path(n, cfg)), S.model_dtype(n, cfg)
        key = (arch.key(), dt, S.SCORERS[n][1])
        if key not in shared:
            shared[key] = S.meta_modules(n, dt, arch) if dry else build_on_gpu(n, arch, dt)
            weights += weights_bytes(S.meta_modules(n, dt, arch))
        mods[n] = shared[key]
    print(f"weights: {weights / GIB:.2f} GiB simulated" + ("" if dry else f", {torch.cuda.memory_allocated() / GIB:.2f} GiB allocated"), flush=True)
    phase_done("1 weights", t, simulated=weights, allocated=None if dry else torch.cuda.memory_allocated())

    # 2. measured vs simulated per model
    t = time.time()
    print("per-model peaks (measured vs simulated):", flush=True)
    for n in names:
        bound = S.scorer_bound(n, cfg)
        for b, l, pre in shapes_for(n, bound):
            sim = S.simulate_peak(n, b, l, prefix=pre, prompt=max(1, pre), exact=False)
            if dry:
                print(f"  {n} B={b} L={l} prefix={pre}: simulated {sim.peak_bytes / GIB:.3f} GiB (would measure)")
                continue
            try:  # pragma: no cover - CUDA-only path
                real = measured_peak(lambda: scorer_pass(n, mods[n], b, l, pre, "cuda"))
            except torch.OutOfMemoryError:
                check(False, f"{n} B={b} L={l}: OOM (simulated {sim.peak_bytes / GIB:.3f} GiB)", "peaks")
                continue
            err = (real - sim.peak_bytes) / max(sim.peak_bytes, 1)
            check(abs(err) <= TOLERANCE, f"{n} B={b} L={l} prefix={pre}: measured {real / GIB:.3f} GiB, simulated "
                  f"{sim.peak_bytes / GIB:.3f} GiB ({err:+.1%})", "peaks")
    phase_done("2 peaks", t)

    # 3. a heavy-tailed workload, planned from the simulation: zero OOM
    t = time.time()
    live = weights if dry else torch.cuda.memory_allocated()  # pragma: no branch
    activation = int(card * cfg.gpu_utilization) - cfg.headroom_bytes - live
    print(f"workload: activation budget {activation / GIB:.2f} GiB x margin {cfg.safety_margin}", flush=True)
    rng = random.Random(0)
    ooms = 0
    planned = 0
    for n in names:
        bound = S.scorer_bound(n, cfg)
        cap = scorer_max_batch(n, cfg, bound)
        cost = fitted_cost(n, bound, S.model_dtype(n, cfg), cap)
        # Heavy-tailed token lengths (about 4 characters a token), each cut to the model's bound.
        lengths = [max(8, min(bound, c // 4)) for c in heavy_tailed_lengths(rng, args.completions, median=1200, cap=40_000)]
        batches = plan_batches(lengths, cost, activation, margin=cfg.safety_margin, max_batch=cap)
        planned += len(batches)
        print(f"  {n}: {len(lengths)} inputs (longest {max(lengths)} tokens) in {len(batches)} batches", flush=True)
        if dry:
            continue
        for batch in batches:  # pragma: no cover - CUDA-only path
            longest = max(lengths[i] for i in batch)
            try:
                with torch.inference_mode():
                    scorer_pass(n, mods[n], len(batch), longest, 0, "cuda")
            except torch.OutOfMemoryError:
                ooms += 1
                print(f"  [FAIL] {n}: OOM at batch {len(batch)} x {longest}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    if not dry:  # pragma: no cover - CUDA-only path
        check(ooms == 0, f"heavy-tailed workload: {ooms} OOMs in {planned} planned batches", "workload")
    phase_done("3 workload", t, batches=planned, ooms=None if dry else ooms)

    # 4. the unbounded reference OpenAssistant call OOMs where the simulation says
    t = time.time()
    left = int(card) - live
    n_oom = length_for_peak("rlhf_reward_model", left)
    print(f"reference OpenAssistant call: {left / GIB:.2f} GiB left on the card; simulated OOM from {n_oom} tokens "
          f"(peak {S.reference_need('rlhf_reward_model', n_oom).peak_bytes / GIB:.2f} GiB)", flush=True)
    if not dry and "rlhf_reward_model" in mods:  # pragma: no cover - CUDA-only path
        deberta = reference_deberta(mods, cfg)
        for length, expect_oom in ((n_oom, True), (int(n_oom * 0.9), False)):
            try:
                measured_peak(lambda: scorer_pass("rlhf_reward_model", deberta, 1, length, 0, "cuda"))
                oom = False
            except torch.OutOfMemoryError:
                oom = True
            gc.collect()
            torch.cuda.empty_cache()
            check(oom == expect_oom, f"reference call at {length} tokens: {'OOM' if oom else 'no OOM'} (expected {'OOM' if expect_oom else 'none'})", "reference")
    phase_done("4 reference", t, n_oom=n_oom)

    # 5. swaps that complete, 6. a real OOM recovered with nothing lost
    swap_phase(names, mods, weights, dry)
    if "rlhf_reward_model" in mods:
        oom_recovery_phase(mods, cfg, card, live, dry)
    # 7. and 8.: DPO on full-size BTLM at its bound; the swap time with and without overlap
    t = time.time()
    check_btlm_at_bound(names, mods, cfg, dry)
    phase_done("7 btlm at bound", t)
    t = time.time()
    check_swap_time(cfg, mods, dry)
    phase_done("8 swap time", t)
    print(f"done in {time.time() - t0:.0f}s; {len(failures)} failures", flush=True)
    record("done", seconds=round(time.time() - t0, 1), failures=failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
