"""The GPU check of the memory simulation: full-size models, random weights, a card of 40 GiB.

Run by scripts/gpu-check.sh when a GPU is lent (under 10 minutes on one card). The card may be far
larger than 40 GiB: `torch.cuda.set_per_process_memory_fraction` caps this process at
`--device-memory` (the `[memory] device_memory` setting's cap), so every figure is a 40 GiB card's.

1. Every active model of the default stack is built from its shipped architecture with random
   weights initialized on the GPU, in its configured dtype, and stays resident.
2. Per model, the scorer's pass at a few shapes (the longest admitted input included): the
   measured peak (torch.cuda.max_memory_allocated above the bytes live before) must be within
   15% of `simulate_peak`'s prediction. [FAIL] otherwise.
3. A heavy-tailed workload (workload.heavy_tailed_lengths, in tokens) is planned per model with
   the cost model fitted to simulated peaks against the activation budget left on the card, and
   every planned batch runs: zero OOM. [FAIL] on any OOM.
4. The unbounded reference OpenAssistant call (DeBERTa-v3-large, float32, batch 1): the
   simulation picks the shortest input whose peak exceeds what the card has left; that input
   must OOM, and one at 90% of that length must not. [FAIL] otherwise.

`--dry-run` runs every CPU part (simulations, the plan of batches, the OOM length) and prints
what it would measure, without a GPU (tests/test_plan.py runs it).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from typing import Any

import torch

from rewardstack.config import default_config
from rewardstack.planning import simulate as S
from rewardstack.memory.budget import weights_bytes
from rewardstack.models import resolve, spec
from rewardstack.memory.costmodel import CostModel
from rewardstack.memory.planner import plan_batches
from rewardstack.plan import scorer_max_batch
from rewardstack.settings import parse_bytes
from rewardstack.workload import heavy_tailed_lengths

GIB = 1024**3
TOLERANCE = 0.15
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    """Print a figure's verdict; remember failures (the script exits 1 on any)."""
    print(("  [ok]   " if ok else "  [FAIL] ") + what, flush=True)
    if not ok:
        failures.append(what)


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
    return mods


def scorer_pass(model: str, mods: tuple, batch: int, length: int, prefix: int, device: str, chunk: int = 512) -> None:
    """The scorer's pass on real tensors (random ids, last row one token short), as the simulation
    runs it. tests/test_simulate.py runs it on CPU under the tracker against the simulation."""
    from rewardstack.scorers import encoding as enc
    from rewardstack.scorers.dpo import LogitHead, chunked_logprobs, logits_scale
    from rewardstack.scorers.prefix import PrefixRunner

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
    from rewardstack.plan import _shapes

    shapes = sorted(set(_shapes(bound)) | {(cap, bound), (cap, max(8, bound // 4))})
    samples = [(b, l, S.simulate_peak(model, b, l, dtype, exact=False, padded=b > 1).peak_bytes) for b, l in shapes]
    return CostModel().fit(samples)


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
            print("no CUDA device: use --dry-run", file=sys.stderr)
            return 2
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, card / total))
        print(f"device: {torch.cuda.get_device_name()} ({total / GIB:.1f} GiB), capped at {card / GIB:.2f} GiB", flush=True)
    t0 = time.time()

    # 1. the stack's models, resident
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

    # 2. measured vs simulated per model
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
                check(False, f"{n} B={b} L={l}: OOM (simulated {sim.peak_bytes / GIB:.3f} GiB)")
                continue
            err = (real - sim.peak_bytes) / max(sim.peak_bytes, 1)
            check(abs(err) <= TOLERANCE, f"{n} B={b} L={l} prefix={pre}: measured {real / GIB:.3f} GiB, simulated "
                  f"{sim.peak_bytes / GIB:.3f} GiB ({err:+.1%})")

    # 3. a heavy-tailed workload, planned from the simulation: zero OOM
    live = weights if dry else torch.cuda.memory_allocated()  # pragma: no branch
    activation = int(card * cfg.gpu_utilization) - cfg.headroom_bytes - live
    print(f"workload: activation budget {activation / GIB:.2f} GiB x margin {cfg.safety_margin}", flush=True)
    rng = random.Random(0)
    ooms = 0
    for n in names:
        bound = S.scorer_bound(n, cfg)
        cap = scorer_max_batch(n, cfg, bound)
        cost = fitted_cost(n, bound, S.model_dtype(n, cfg), cap)
        # Heavy-tailed token lengths (about 4 characters a token), each cut to the model's bound.
        lengths = [max(8, min(bound, c // 4)) for c in heavy_tailed_lengths(rng, args.completions, median=1200, cap=40_000)]
        batches = plan_batches(lengths, cost, activation, margin=cfg.safety_margin, max_batch=cap)
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
        check(ooms == 0, f"heavy-tailed workload: {ooms} OOMs")

    # 4. the unbounded reference OpenAssistant call OOMs where the simulation says
    left = int(card) - live
    n_oom = S.length_for_peak("rlhf_reward_model", left)
    print(f"reference OpenAssistant call: {left / GIB:.2f} GiB left on the card; simulated OOM from {n_oom} tokens "
          f"(peak {S.reference_need('rlhf_reward_model', n_oom).peak_bytes / GIB:.2f} GiB)", flush=True)
    if not dry and "rlhf_reward_model" in mods:  # pragma: no cover - CUDA-only path
        deberta = mods["rlhf_reward_model"]
        if S.model_dtype("rlhf_reward_model", cfg) != "float32":
            deberta = build_on_gpu("rlhf_reward_model", S.load_arch(S.model_path("rlhf_reward_model", cfg)), "float32")
        for length, expect_oom in ((n_oom, True), (int(n_oom * 0.9), False)):
            try:
                measured_peak(lambda: scorer_pass("rlhf_reward_model", deberta, 1, length, 0, "cuda"))
                oom = False
            except torch.OutOfMemoryError:
                oom = True
            gc.collect()
            torch.cuda.empty_cache()
            check(oom == expect_oom, f"reference call at {length} tokens: {'OOM' if oom else 'no OOM'} (expected {'OOM' if expect_oom else 'none'})")
    print(f"done in {time.time() - t0:.0f}s; {len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
