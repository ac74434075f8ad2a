"""Memory benchmark: cost-model predictions versus tracker-measured peaks, and a full-stack run.

Run: `.venv/bin/python -m bench.memory` (a few minutes on 2 CPU cores). For each scorer family's
architecture (tiny random models built from configs, like the stand-ins) it calibrates the cost
model on the profile grid, then measures the peak of off-grid shapes with the tensor-bytes tracker
and prints predicted vs measured and the error (target: within 15%); then the same for every scorer
of the stand-in stack, each with its own cost model and profile run. Then the whole stand-in stack scores
`heavy_tailed_steps()` (9 steps x 50 completions, one of 40,000 characters) under a simulated budget
and prints the tracker's peak against that budget. Last, hostile input: one 50 MB completion through
`rewardstack score` (spaced words, and one 50 MB word) against the same steps without it: wall time,
peak RSS of the `score` process and the completion's status (`--row huge-completion` runs only that
row; target: under 1.5x the memory, in seconds, status `cut`). `--row prediction`: only the
per-model prediction error over the bench workload (`bench.prediction`). Every number is measured.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch

from bench.common import check_cost_model
from rewardstack._memory import MemoryManager, Profile
from memory_models import LOGIT_CHUNK, build

FAMILIES = {
    "deberta": "DeBERTa-v2 classifier (rlhf_reward_model)",
    "roberta": "RoBERTa classifier (nsfw_filter)",
    "bert": "BERT/MiniLM embedding (relevance, diversity)",
    "gptj": "GPT-J classifier (reciprocate, dahoas)",
    "llama": "Llama causal LM, chunked logits (dpo, prompt)",
}
MAX_LENGTH = 512
MAX_BATCH = 8
GRID = [(b, l) for b in (1, 3, 6) for l in (24, 96, 200, 384, 512)]


def cost_model_table() -> float:
    """Calibrate each family, compare predictions to measured peaks on an off-profile grid."""
    print(f"== cost model: predicted vs measured peak activation bytes (profile up to B={MAX_BATCH}, L={MAX_LENGTH}) ==")
    print(f"{'family':<9} {'B':>2} {'L':>4} {'predicted':>12} {'measured':>12} {'error':>7}")
    worst_all = 0.0
    summary = []
    for fam, desc in FAMILIES.items():
        t = time.time()
        _, run = build(fam)
        mm = MemoryManager(None)
        cm = mm.calibrate(Profile(fam, run, max_length=MAX_LENGTH, max_batch=MAX_BATCH, chunk=LOGIT_CHUNK if fam == "llama" else None))
        errs = []
        for b, l in GRID:
            measured = mm.measure(lambda: run(b, l))
            pred = cm.predict(b, l)
            err = (pred - measured) / measured
            errs.append(err)
            print(f"{fam:<9} {b:>2} {l:>4} {pred:>12,.0f} {measured:>12,} {err:>+7.1%}")
        worst = max(abs(e) for e in errs)
        worst_all = max(worst_all, worst)
        summary.append((fam, desc, worst, min(errs), cm.describe(), time.time() - t))
    print()
    print(f"{'family':<9} {'architecture':<46} {'max |err|':>9} {'worst under':>11} {'time':>6}")
    for fam, desc, worst, under, _, dt in summary:
        print(f"{fam:<9} {desc:<46} {worst:>9.1%} {min(under, 0):>11.1%} {dt:>5.1f}s")
    for fam, _, _, _, d, _ in summary:
        print(f"  {fam}: {d.split(' (trust')[0]}")
    print(f"worst error over all families: {worst_all:.1%} (target 15%): {'PASS' if worst_all <= 0.15 else 'FAIL'}")
    return worst_all


def scorer_table(shapes: tuple[tuple[int, int], ...] = ((3, 48), (5, 200), (2, 300), (6, 400))) -> float:
    """Each stand-in scorer's own cost model against its own profile run at shapes off its grid."""
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack
    from rewardstack._standins import make_standins

    print()
    print("== each scorer of the stand-in stack: predicted vs measured peak at shapes off the profile grid ==")
    print(f"{'scorer':<26} {'B':>3} {'L':>5} {'predicted':>12} {'measured':>12} {'error':>7}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(make_standins(Path(tmp) / "standins"))
        cfg.state_dir = str(Path(tmp) / "state")
        for name in ("dahoas_reward_model", "prompt_reward_model"):
            cfg.models[name].weight = 0.1  # on, so that every scorer is measured
        cfg.models["rlhf_reward_model"].weight = 0.2
        stack = RewardStack(cfg)
        mm = stack.memory
        for name, cost in mm.cost_models.items():
            top = max(l for _, l, _ in cost.samples)
            for b, l, pred, meas in check_cost_model(mm, name, [(b, min(l, top - 1)) for b, l in shapes]):
                err = (pred - meas) / max(meas, 1)
                worst = max(worst, abs(err))
                print(f"{name:<26} {b:>3} {l:>5} {pred:>12,.0f} {meas:>12,} {err:>+7.1%}")
    print(f"worst error over every scorer: {worst:.1%} (target 15%): {'PASS' if worst <= 0.15 else 'FAIL'}")
    return worst


def full_stack(budget: int = 64 * 1024**2) -> None:
    """Score the 9-step, 50-completion heavy-tailed workload on the stand-ins under a simulated budget."""
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack
    from rewardstack._standins import make_standins
    from tests.soak.synthetic import heavy_tailed_steps

    steps = heavy_tailed_steps()
    print()
    print(f"== full stack on heavy_tailed_steps() ({len(steps)} steps x {len(steps[0].completions)}, "
          f"one 40,000-char completion) under a simulated budget of {budget / 1024**2:.0f} MiB ==")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(make_standins(Path(tmp) / "standins"))
        cfg.memory_budget = budget
        cfg.state_dir = str(Path(tmp) / "state")
        t = time.time()
        stack = RewardStack(cfg)
        load_s = time.time() - t
        mm = stack.memory
        assert mm.tracker is not None and mm.budget_bytes == budget
        t = time.time()
        statuses: dict[str, int] = {}
        with mm.tracker.window("stack") as w:
            for step in steps:
                res = stack.score_step(step, save=False)
                for s in res.statuses:
                    statuses[s] = statuses.get(s, 0) + 1
        run_s = time.time() - t
    peak = w.peak_bytes
    print(f"steps {len(steps)}, completions {sum(len(s.completions) for s in steps)}, load {load_s:.1f}s, scoring {run_s:.1f}s")
    print(f"tracker peak {peak / 1024**2:.2f} MiB vs budget {budget / 1024**2:.0f} MiB: {'WITHIN' if peak <= budget else 'OVER'} "
          f"({peak / budget:.0%}); OOMs {len(mm.oom_log)}; statuses {statuses}")


HUGE_CHARS = 50_000_000


def _score_rss(config: Path, steps: Path, out: Path) -> tuple[float, int, list[dict]]:
    """Run `rewardstack score` in a child process: (wall seconds, peak RSS bytes, events)."""
    import os
    import subprocess
    import sys

    t = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "rewardstack.cli", "-q", "score", "--config", str(config),
                             "--input", str(steps), "--output", str(out)], stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"score exited {proc.returncode}"
    import json

    events = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n")[:-1]]
    return wall, usage.ru_maxrss * 1024, events


def huge_completion_row(chars: int = HUGE_CHARS, budget: int | None = None) -> None:
    """One completion of `chars` characters through `score` against the same steps without it.

    `budget`: an activation budget for every run (None: the stand-ins' config, none on CPU). The
    64 MiB of the full-stack row gave the same peak RSS and a 7x longer run (2026-12-01).
    """
    extra = f"\nmemory_budget = {budget}" if budget else ""
    import json

    from rewardstack._standins import make_standins

    print()
    print(f"== hostile input: one {chars / 1e6:.0f} MB completion through `rewardstack score` (stand-in stack, "
          f"every model on; [input] max_chars 65536; budget {f'{budget / 1024**2:.0f} MiB' if budget else 'none'}) ==")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = make_standins(root / "standins")
        base = [{"name": "augment", "prompt": f"Write about reward models, part {k}.",
                 "completions": [f"Reward model answer {k}.{j}: the model scores text." for j in range(8)]}
                for k in range(3)]
        rows: list = []
        warm = config.parent / "stack-warm.toml"  # profiles every model once; each run then reads that cache
        warm.write_text(config.read_text(encoding="utf-8").replace(
            'state_dir = "state"', f'state_dir = "state-warm"{extra}'), encoding="utf-8")
        (root / "warm.jsonl").write_text(json.dumps(base[0]) + "\n", encoding="utf-8")
        _score_rss(warm, root / "warm.jsonl", root / "warm.out")
        limit = 65_536  # [input] max_chars: the largest completion the models read whole
        inputs = (("without", None), (f"{limit:,} chars", ("word " * (limit // 5 + 1))[:limit]),
                  ("spaced words", "word " * (chars // 5)), ("one word", "x" * chars))
        for label, huge in inputs:
            steps = [dict(s, completions=list(s["completions"])) for s in base]
            if huge is not None:
                steps[1]["completions"][3] = huge.strip()
            path = root / f"steps-{len(rows)}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
            del huge, steps
            cfg = config.parent / f"stack-{len(rows)}.toml"  # own state: every run starts alike
            text = config.read_text(encoding="utf-8").replace(
                'state_dir = "state"', f'state_dir = "state-{len(rows)}"{extra}')
            cfg.write_text(text, encoding="utf-8")  # the warm run's fits are read: one cache, keyed by checkpoint
            wall, rss, events = _score_rss(cfg, path, root / f"ev-{len(rows)}.jsonl")
            status = events[1]["statuses"][3]
            rows.append((label, wall, rss, status))
    base_rss = rows[0][2]
    print(f"{'input':<14} {'wall s':>7} {'vs without':>16} {'peak RSS MiB':>13} {'vs without':>10}  status of the long completion")
    for label, wall, rss, status in rows:
        print(f"{label:<14} {wall:>7.1f} {wall - rows[0][1]:>+8.1f}s {wall / rows[0][1]:>5.2f}x "
              f"{rss / 1024**2:>13.0f} {rss / base_rss:>9.2f}x  {status}")
    big = [r for r in rows if r[0] in ("spaced words", "one word")]
    worst = max(r[2] for r in big) / base_rss
    cut = all(r[3] == "cut" for r in big)
    print(f"peak RSS with the 50 MB completion / without: {worst:.2f}x (target < 1.5x): {'PASS' if worst < 1.5 else 'FAIL'}; "
          f"status cut: {'PASS' if cut else 'FAIL'}; 50 MB vs {rows[1][0]}: {max(r[1] for r in big) - rows[1][1]:+.1f}s, "
          f"{(max(r[2] for r in big) - rows[1][2]) / 1024**2:+.0f} MiB")
    import os

    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    """Print the tables (`--row huge-completion`: only the hostile-input row)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", choices=("huge-completion", "prediction"), help="run only this row")
    args = ap.parse_args()
    if args.row == "huge-completion":
        huge_completion_row()
        return
    if args.row == "prediction":  # the per-model prediction error over the bench workload
        from bench import prediction

        prediction.main([])
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keep the table readable: no load bars or length warnings
    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    t = time.time()
    cost_model_table()
    scorer_table()
    full_stack()
    huge_completion_row()
    print(f"\ntotal {time.time() - t:.0f}s")


if __name__ == "__main__":
    main()
