"""Benchmark of the decoder scorers (DPO, Reciprocate, Dahoas, judge) on the stand-ins.

Run: `.venv/bin/python -m bench.causal [--ref-steps N] [--no-prop] [--dpo-only]`. On the 9-step,
50-completion heavy-tailed workload it prints, per scorer: completions/s and peak tracked tensor
bytes for rewardstack, for the literal per-completion reference (from the tests; timed on a subset
of steps, the same subset rewardstack's per-step times are summed over), and for the floor: the
body's forward passes over the step's common token prefix once plus each input's remaining tokens
attending to the cached prefix, timed alone in the same run.

DPO runs on two stand-ins of the same family (GPT-2 body, the BERT tokenizer, 8k positions):
- the tiny CI one (hidden 64, 2 layers): its LM head costs ~20x its body per token, so no exact
  implementation can approach a body-only floor on it;
- a proportioned one (default hidden 512, 8 layers), whose body outweighs its head per token, nearer
  BTLM-3B (where the head is ~5% of a token's work; a CPU bench cannot afford that ratio).
For each it also prints the floor plus the head's matmul over the scored rows (work the exact
semantics need), the ratios against the targets, met or not, and for the tiny one the peak
of one 8,000-token call against the L x V full-logit figure.

Timings run without the tensor tracker (as on a GPU, where the allocator counts for free); peaks
come from a separate tracked pass.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import MiB, peak_of, timed
from bench import floors
from bench.floors import BTLM_RATIO, floor_body, work_ratio
from causal_fixtures import model_config, reference_dahoas, reference_dpo

from rewardstack._memory import MemoryManager
from rewardstack._scorers import dahoas, dpo, judge, reciprocate
from rewardstack._scorers.base import Runtime, ScoreRequest
from rewardstack._scorers.loading import ModelCache
from rewardstack._standins import make_dahoas_standin, make_dpo_standin, make_judge_standin, make_reciprocate_standin
from tests.soak.synthetic import Step, heavy_tailed_steps, text


def runtime(tracked: bool) -> Runtime:
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu))


def untracked(scorer: Any) -> Any:
    """Drop the simulated device's tracker after calibration, so timings pay no dispatch hook."""
    scorer.runtime.memory.tracker = None
    return scorer


def n_live(steps: list[Step]) -> int:
    return sum(sum(c is not None for c in s.completions) for s in steps)


def row(name: str, n: int, secs: float, peak: int | None, note: str = "") -> list[str]:
    p = f"{peak / MiB:9.1f}" if peak is not None else "        -"
    return [f"{name:52s}", f"{n:5d}", f"{secs:8.2f}", f"{n / secs:9.1f}", p, note]


def print_table(rows: list[list[str]]) -> None:
    print(f"{'run':52s} {'n':>5s} {'secs':>8s} {'compl/s':>9s} {'peak MiB':>9s}  note")
    for r in rows:
        print(" ".join(r[:5]) + ("  " + r[5] if r[5] else ""))


def bench_dpo(root: Path, label: str, overrides: dict | None, steps: list[Step], ref_idx: list[int],
              out: list[list[str]], peaks: bool, options: dict | None = None) -> dict:
    """One DPO stand-in: rewardstack (per step), the literal reference on the `ref_idx` steps, the
    body-only floor and the head's matmul on the scored rows; peaks on request. `options`: the
    scorer's own options (`--smoke`: a short calibration, no chunk tuning)."""
    folder = root / f"dpo_{label}"
    entry = make_dpo_standin(folder, config_overrides=overrides)
    cfg = model_config("dpo_reward_model", folder, entry, **({"options": options} if options else {}))
    t_load = time.perf_counter()
    sc = untracked(dpo.build(cfg, runtime(False)))
    t_load = time.perf_counter() - t_load
    reqs = [ScoreRequest(s.prompt, s.completions, s.name) for s in steps]
    sc.score(ScoreRequest(steps[0].prompt, [steps[0].completions[0]]))  # warm-up (first-call costs)
    per_step = [timed(lambda r=r: sc.score(r)) for r in reqs]
    t_rs, n = sum(per_step), n_live(steps)
    ref_steps = [steps[k] for k in ref_idx]
    ref_n = n_live(ref_steps)
    t_rs_sub = sum(per_step[k] for k in ref_idx)  # the same steps the reference is timed on
    # The floor's inputs: what the scorer runs (ids cut to max_len, short completions skipped).
    tok = sc.tokenizer
    _, n_rows = floors.dpo_inputs(sc, steps)
    t_floor, t_head = floors.dpo(sc, steps)
    t_ref = timed(lambda: [reference_dpo(sc.model, tok, s.prompt, c) for s in ref_steps for c in s.completions if c is not None])
    steps_txt = "all 9 steps" if len(ref_idx) == len(steps) else "steps " + ",".join(str(k) for k in ref_idx)
    peak_rs = peak_ref = None
    res: dict = {}
    if peaks:
        tracked = dpo.build(cfg, runtime(True))
        peak_rs = max(peak_of(lambda r=r: tracked.score(r)) for r in reqs)
        longest = max((c for s in ref_steps for c in s.completions if c), key=len)
        peak_ref = peak_of(lambda: reference_dpo(sc.model, tok, ref_steps[0].prompt, longest))
        # One 8,000-token call: peak vs the full-logit L x V figure.
        comp = text(random.Random(7), 40_000)
        ids = tok("Q: " + comp).input_ids[: sc.max_len]
        res["peak_long"] = peak_of(lambda: tracked.score(ScoreRequest("Q: ", [comp])))
        res["long_tokens"], res["full_logits"] = len(ids), len(ids) * sc.logit_head.vocab * 4
    tag = f"dpo[{label}]"
    out += [
        row(f"{tag} rewardstack (9 steps)", n, t_rs, peak_rs),
        row(f"{tag} rewardstack ({steps_txt})", ref_n, t_rs_sub, None, "same steps as the reference"),
        row(f"{tag} reference ({steps_txt})", ref_n, t_ref, peak_ref,
            ("whole workload" if len(ref_idx) == len(steps) else "subset: the per-position loop is slow")
            + ("; peak = its longest input" if peaks else "")),
        row(f"{tag} floor: body, prefix once", n, t_floor, None),
        row(f"{tag} floor + head", n, t_floor + t_head, None, f"head (matmul + log-sum-exp) on the {n_rows} scored rows, timed alone"),
    ]
    c = sc.model.config
    res.update({
        "label": label, "shape": f"hidden {c.n_embd}, {c.n_layer} layers, vocab {c.vocab_size}",
        "work_ratio": work_ratio(c), "ref_steps": steps_txt,
        "speedup_vs_ref": (ref_n / t_rs_sub) / (ref_n / t_ref),
        "vs_floor": t_rs / t_floor, "vs_floor_head": t_rs / (t_floor + t_head),
        "chunk": sc.chunks.chunk, "max_chunk": sc.chunks.max_chunk, "load_s": t_load,
    })
    return res


def report_dpo(d: dict) -> None:
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(f"DPO [{d['label']}: {d['shape']}; head/body work per token {d['work_ratio']:.2f}, "
          f"BTLM-3B {BTLM_RATIO:.2f}]")
    print(f"  speedup vs reference ({d['ref_steps']}):  {d['speedup_vs_ref']:6.1f}x  "
          f"(target >= 10x: {verdict(d['speedup_vs_ref'] >= 10)})")
    print(f"  time / floor (body only):            {d['vs_floor']:6.2f}x  "
          f"(target <= 1.5x: {verdict(d['vs_floor'] <= 1.5)})")
    print(f"  time / (floor + head):               {d['vs_floor_head']:6.2f}x  (no target: work the semantics need)")
    print(f"  logits chunk {d['chunk']} rows (tuned at load, cap {d['max_chunk']}); load + calibration {d['load_s']:.1f} s")
    if "peak_long" in d:
        print(f"  {d['long_tokens']}-token call: peak {d['peak_long'] / MiB:.1f} MiB "
              f"vs full logits L x V x 4 = {d['full_logits'] / MiB:.1f} MiB")


def bench_other(root: Path, steps: list[Step], ref_steps: list[Step], out: list[list[str]]) -> dict:
    ratios: dict[str, float] = {}
    n, ref_n = n_live(steps), n_live(ref_steps)
    # Reciprocate
    folder = root / "rec"
    cfg = model_config("reciprocate_reward_model", folder, make_reciprocate_standin(folder))
    sc = untracked(reciprocate.build(cfg, runtime(False)))
    t = timed(lambda: [sc.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in steps])

    def rec_ref(p: str, c: str) -> float:
        inp = sc.tokenizer(reciprocate.TEMPLATE.format(prompt=p, completion=c), return_tensors="pt", truncation=True)
        with torch.no_grad():
            return float(sc.model(**inp).logits[0])

    t_ref = timed(lambda: [rec_ref(s.prompt, c) for s in ref_steps for c in s.completions if c is not None])
    t_floor = floors.reciprocate_floor(sc, steps)
    out += [row("reciprocate rewardstack", n, t, None), row(f"reciprocate reference ({len(ref_steps)} steps)", ref_n, t_ref, None),
            row("reciprocate floor", n, t_floor, None)]
    ratios["reciprocate_vs_floor"] = t / t_floor
    ratios["reciprocate_vs_ref"] = (n / t) / (ref_n / t_ref)
    # Dahoas
    folder = root / "dah"
    cfg = model_config("dahoas_reward_model", folder, make_dahoas_standin(folder))
    sc2 = untracked(dahoas.build(cfg, runtime(False)))
    t = timed(lambda: [sc2.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in steps])
    t_ref = timed(lambda: [reference_dahoas(sc2.body, sc2.head, sc2.tokenizer, s.prompt, c)
                           for s in ref_steps for c in s.completions if c is not None])
    groups = []
    for s in steps:
        for texts in ([dahoas.wrap(s.prompt + c) for c in s.completions if c is not None],
                      [dahoas.wrap(c) for c in s.completions if c is not None]):
            ids = sc2.tokenizer(texts).input_ids
            groups.append([x[: dahoas.read_position(x, sc2.eos_id) + 1][: sc2.max_len] for x in ids])
    t_floor = timed(lambda: floor_body(sc2.body, groups))
    out += [row("dahoas rewardstack", n, t, None), row(f"dahoas reference ({len(ref_steps)} steps)", ref_n, t_ref, None),
            row("dahoas floor", n, t_floor, None)]
    ratios["dahoas_vs_floor"] = t / t_floor
    ratios["dahoas_vs_ref"] = (n / t) / (ref_n / t_ref)
    # Judge (no floor: generation is its own work)
    folder = root / "judge"
    cfg = model_config("prompt_reward_model", folder, make_judge_standin(folder))
    sc3 = untracked(judge.build(cfg, runtime(False)))
    t = timed(lambda: [sc3.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in steps])
    out.append(row("judge rewardstack", n, t, None, "batched 2-token greedy generation"))
    return ratios


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keep the table readable: no load bars or length warnings
    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-steps", type=int, default=2,
                    help="steps the slow references are timed on (proportioned DPO stand-in, Reciprocate, Dahoas)")
    ap.add_argument("--tiny-ref-steps", type=int, default=9,
                    help="steps the DPO reference is timed on for the tiny stand-in (9 = the whole workload)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier timings when other jobs share the cores)")
    ap.add_argument("--prop-hidden", type=int, default=512, help="proportioned DPO stand-in: hidden size")
    ap.add_argument("--prop-layers", type=int, default=8, help="proportioned DPO stand-in: layers")
    ap.add_argument("--no-prop", action="store_true", help="skip the proportioned DPO stand-in")
    ap.add_argument("--dpo-only", action="store_true", help="skip Reciprocate, Dahoas and the judge")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    steps = heavy_tailed_steps()
    # The reference subset skips the step holding the 40,000-character completion (its full logits
    # alone are ~1 GB and its per-position loop takes minutes); the rest is typical traffic.
    long_step = len(steps) // 2
    ref_idx = [k for k in range(len(steps)) if k != long_step][: args.ref_steps]
    ref_steps = [steps[k] for k in ref_idx]
    out: list[list[str]] = []
    dpos: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # On the tiny stand-in the reference is cheap enough to time on the whole workload, the
        # 40,000-character completion included (about 20 s at 1 thread).
        tiny_idx = list(range(len(steps)))[: args.tiny_ref_steps] if args.tiny_ref_steps >= len(steps) else ref_idx
        dpos.append(bench_dpo(root, "tiny CI stand-in", None, steps, tiny_idx, out, peaks=True))
        if not args.no_prop:
            heads = max(1, args.prop_hidden // 64)
            prop = {"n_embd": args.prop_hidden, "n_layer": args.prop_layers, "n_head": heads}
            dpos.append(bench_dpo(root, "proportioned stand-in", prop, steps, ref_idx, out, peaks=False))
        r = {} if args.dpo_only else bench_other(root, steps, ref_steps, out)
    print(f"workload: {len(steps)} steps x {len(steps[0].completions)} completions (heavy-tailed, one 40,000 chars); "
          f"threads: {torch.get_num_threads()}")
    print_table(out)
    print()
    for d in dpos:
        report_dpo(d)
    for k, v in r.items():
        print(f"{k}: {v:.2f}x")
    print(f"bench wall time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
