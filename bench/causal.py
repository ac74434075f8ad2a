"""Benchmark of the decoder scorers (DPO, Reciprocate, Dahoas, judge) on the stand-ins.

Run: `.venv/bin/python bench/causal.py [--ref-steps N]`. On the 9-step, 50-completion heavy-tailed
workload it prints, per scorer: completions/s and peak tracked tensor bytes for rewardstack, for
the literal per-completion reference (from the tests; timed on a subset of steps when slow, as the
table says), and for the floor: the body's forward passes over the step's common token prefix once
plus each input's remaining tokens attending to the cached prefix, timed alone in the same run.
For DPO it also prints the floor plus the LM head over the scored rows (work the semantics need),
and the peak of one 8,000-token call against the L x V full-logit figure.

Timings run without the tensor tracker (as on a GPU, where the allocator counts for free); peaks
come from a separate tracked pass.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from causal_fixtures import model_config, reference_dahoas, reference_dpo  # noqa: E402

from rewardstack.memory import MemoryManager, TensorBytesTracker  # noqa: E402
from rewardstack.scorers import dahoas, dpo, judge, reciprocate  # noqa: E402
from rewardstack.scorers.base import Runtime, ScoreRequest  # noqa: E402
from rewardstack.scorers.loading import ModelCache  # noqa: E402
from rewardstack.scorers.prefix import PrefixRunner, padding_groups, split_prefix  # noqa: E402
from rewardstack.workload import Step, heavy_tailed_steps, text  # noqa: E402

MiB = 2**20


def runtime(tracked: bool) -> Runtime:
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu))


def untracked(scorer: Any) -> Any:
    """Drop the simulated device's tracker after calibration, so timings pay no dispatch hook."""
    scorer.runtime.memory.tracker = None
    return scorer


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def peak_of(fn: Callable[[], Any]) -> int:
    tracker = TensorBytesTracker(None)
    with torch.inference_mode(), tracker.window("peak") as w:
        fn()
    return w.peak_increase


def n_live(steps: list[Step]) -> int:
    return sum(sum(c is not None for c in s.completions) for s in steps)


def floor_body(body: torch.nn.Module, groups_of_ids: list[list[list[int]]], head: Callable | None = None,
               rows: list[list[tuple[int, int]]] | None = None) -> None:
    """Prefix once per group, suffixes batched in padding groups; optionally the head on scored rows."""
    with torch.inference_mode():
        for g, ids in enumerate(groups_of_ids):
            prefix, _ = split_prefix(ids)
            runner = PrefixRunner(body, prefix)
            for grp in padding_groups([len(x) for x in ids]):
                h, _ = runner.run([ids[k][len(prefix):] for k in grp])
                if head is not None and rows is not None:
                    seq = torch.cat([torch.full((b - a,), j) for j, k in enumerate(grp) for a, b in [rows[g][k]]])
                    pos = torch.cat([torch.arange(a, b) for k in grp for a, b in [rows[g][k]]])
                    for c0 in range(0, len(seq), 512):
                        head(runner.rows(h, seq[c0:c0 + 512], pos[c0:c0 + 512]))


def row(name: str, n: int, secs: float, peak: int | None, note: str = "") -> list[str]:
    p = f"{peak / MiB:9.1f}" if peak is not None else "        -"
    return [f"{name:34s}", f"{n:5d}", f"{secs:8.2f}", f"{n / secs:9.1f}", p, note]


def print_table(rows: list[list[str]]) -> None:
    print(f"{'run':34s} {'n':>5s} {'secs':>8s} {'compl/s':>9s} {'peak MiB':>9s}  note")
    for r in rows:
        print(" ".join(r[:5]) + ("  " + r[5] if r[5] else ""))


def bench_dpo(root: Path, steps: list[Step], ref_steps: list[Step], out: list[list[str]]) -> dict:
    folder = root / "dpo"
    entry = dpo.make_standin(folder)
    cfg = model_config("dpo_reward_model", folder, entry)
    sc = untracked(dpo.build(cfg, runtime(False)))
    reqs = [ScoreRequest(s.prompt, s.completions, s.name) for s in steps]
    n = n_live(steps)
    t_rs = timed(lambda: [sc.score(r) for r in reqs])
    tracked = dpo.build(cfg, runtime(True))
    peak_rs = max(peak_of(lambda r=r: tracked.score(r)) for r in reqs)
    # The floor's inputs: what the scorer runs (ids cut to max_len, short completions skipped).
    tok = sc.tokenizer
    groups, rows_ = [], []
    for s in steps:
        p = len(tok(s.prompt).input_ids)
        ids = [x[: sc.max_len] for x in tok([s.prompt + c for c in s.completions if c and len(c) > 5]).input_ids]
        groups.append(ids)
        rows_.append([(p - 1, len(x) - 1) for x in ids])
    t_floor = timed(lambda: floor_body(sc.body, groups))
    t_floor_head = timed(lambda: floor_body(sc.body, groups, sc._head, rows_))
    ref_n = n_live(ref_steps)
    t_ref = timed(lambda: [reference_dpo(sc.model, tok, s.prompt, c) for s in ref_steps for c in s.completions if c is not None])
    longest = max((c for s in ref_steps for c in s.completions if c), key=len)
    peak_ref = peak_of(lambda: reference_dpo(sc.model, tok, ref_steps[0].prompt, longest))
    t_rs_sub = timed(lambda: [sc.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in ref_steps])
    out += [
        row("dpo rewardstack (9 steps)", n, t_rs, peak_rs),
        row(f"dpo rewardstack ({len(ref_steps)} ref steps)", ref_n, t_rs_sub, None),
        row(f"dpo reference ({len(ref_steps)} steps)", ref_n, t_ref, peak_ref, "subset: per-position loop is slow; peak = its longest input"),
        row("dpo floor: body, prefix once", n, t_floor, None),
        row("dpo floor + head on scored rows", n, t_floor_head, None),
    ]
    # One 8,000-token call: peak vs the full-logit L x V figure.
    comp = text(random.Random(7), 40_000)
    ids = tok("Q: " + comp).input_ids[: sc.max_len]
    peak_long = peak_of(lambda: tracked.score(ScoreRequest("Q: ", [comp])))
    full = len(ids) * sc.lm_head.weight.shape[0] * 4
    return {
        "speedup_vs_ref": (ref_n / t_rs_sub) / (ref_n / t_ref),
        "vs_floor": t_rs / t_floor,
        "vs_floor_head": t_rs / t_floor_head,
        "long_tokens": len(ids), "peak_long": peak_long, "full_logits": full, "chunk": sc.chunk,
    }


def bench_other(root: Path, steps: list[Step], ref_steps: list[Step], out: list[list[str]]) -> dict:
    ratios: dict[str, float] = {}
    n, ref_n = n_live(steps), n_live(ref_steps)
    # Reciprocate
    folder = root / "rec"
    cfg = model_config("reciprocate_reward_model", folder, reciprocate.make_standin(folder))
    sc = untracked(reciprocate.build(cfg, runtime(False)))
    t = timed(lambda: [sc.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in steps])

    def rec_ref(p: str, c: str) -> float:
        inp = sc.tokenizer(reciprocate.TEMPLATE.format(prompt=p, completion=c), return_tensors="pt", truncation=True)
        with torch.no_grad():
            return float(sc.model(**inp).logits[0])

    t_ref = timed(lambda: [rec_ref(s.prompt, c) for s in ref_steps for c in s.completions if c is not None])
    groups = [reciprocate.tokenize_bounded(sc.tokenizer, [reciprocate.TEMPLATE.format(prompt=s.prompt, completion=c)
                                                          for c in s.completions if c is not None], sc.max_len)[0] for s in steps]
    t_floor = timed(lambda: floor_body(sc.body, groups))
    out += [row("reciprocate rewardstack", n, t, None), row(f"reciprocate reference ({len(ref_steps)} steps)", ref_n, t_ref, None),
            row("reciprocate floor", n, t_floor, None)]
    ratios["reciprocate_vs_floor"] = t / t_floor
    ratios["reciprocate_vs_ref"] = (n / t) / (ref_n / t_ref)
    # Dahoas
    folder = root / "dah"
    cfg = model_config("dahoas_reward_model", folder, dahoas.make_standin(folder))
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
    cfg = model_config("prompt_reward_model", folder, judge.make_standin(folder))
    sc3 = untracked(judge.build(cfg, runtime(False)))
    t = timed(lambda: [sc3.score(ScoreRequest(s.prompt, s.completions, s.name)) for s in steps])
    out.append(row("judge rewardstack", n, t, None, "batched 2-token greedy generation"))
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-steps", type=int, default=2, help="steps the slow references are timed on")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier timings when other jobs share the cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    steps = heavy_tailed_steps()
    # The reference subset skips the step holding the 40,000-character completion (its full logits
    # alone are ~1 GB and its per-position loop takes minutes); the rest is typical traffic.
    long_step = len(steps) // 2
    ref_steps = [s for k, s in enumerate(steps) if k != long_step][: args.ref_steps]
    out: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        d = bench_dpo(root, steps, ref_steps, out)
        r = bench_other(root, steps, ref_steps, out)
    print(f"workload: {len(steps)} steps x {len(steps[0].completions)} completions (heavy-tailed, one 40,000 chars); "
          f"threads: {torch.get_num_threads()}")
    print_table(out)
    print()
    print(f"DPO speedup vs reference (same {len(ref_steps)} steps): {d['speedup_vs_ref']:.1f}x (target >= 10x)")
    print(f"DPO time / floor (body only):          {d['vs_floor']:.2f}x (target <= 1.5x)")
    print(f"DPO time / floor + head on scored rows: {d['vs_floor_head']:.2f}x")
    print(f"DPO {d['long_tokens']}-token call: peak {d['peak_long'] / MiB:.1f} MiB (logits chunk {d['chunk']} rows) "
          f"vs full logits L x V x 4 = {d['full_logits'] / MiB:.1f} MiB")
    for k, v in r.items():
        print(f"{k}: {v:.2f}x")


if __name__ == "__main__":
    main()
