"""Benchmark: DPO on the BTLM-like stand-ins, blocked attention against the model's own, one run.

Run: `.venv/bin/python -m bench.attention [--quick] [--out FILE]`. Two BTLM-like remote-code
stand-ins (`rewardstack._planning.btlm`): the tiny CI one (2 layers, width 64, 4 heads) and a
proportioned one (4 layers, width 256, 4 heads, so attention is a real share of the pass). Each is
loaded once by the DPO scorer with its own attention (`attention = "own"`); then each shape runs
with the model's own attention and, after `attention.install` (the load-time replacement, probe
included), with 512-row blocks, interleaved, fastest of `repeats` runs each. Shapes: short inputs
(8 x 200 tokens: one block, the target is at most 1.1x the own time) and long ones (1 x 2,048 and
1 x 8,192 tokens, the reference's bound). Per row: seconds, their ratio, tracked peak bytes of
one pass with each, and the largest score difference (they must agree).

The target: blocked no slower than 1.1x at short inputs; at 8,192 tokens the table says what it is.
Timings on a shared machine are noise; read the ratios, on a quiet one.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import MiB, peak_of
from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager
from rewardstack._scorers import attention, dpo
from rewardstack._scorers.base import Runtime
from rewardstack._scorers.loading import ModelCache
from rewardstack._scorers.prefix import PrefixRunner
from rewardstack._standins import make_btlm_checkpoint

TARGET_SHORT = 1.1
STANDINS = {
    "tiny (2L, 64w, 4h)": {},
    "proportioned (4L, 256w, 4h)": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_inner": 512},
}


def _scorer(folder: Path) -> dpo.DpoScorer:
    cpu = torch.device("cpu")
    cfg = ModelConfig(name="dpo_reward_model", path=str(folder), weight=1.0, dtype="float32", trust_remote_code=True,
                      options={"tune_logits_chunk": False, "calibration_length": 64, "attention": "own"})
    return dpo.build(cfg, Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu)))  # type: ignore[return-value]


def _ids(sc: dpo.DpoScorer, batch: int, length: int) -> list[list[int]]:
    rng = random.Random(length)
    return [[rng.randrange(1000, sc.vocab) for _ in range(length)] for _ in range(batch)]


def _pass(sc: dpo.DpoScorer, ids: list[list[int]]) -> list[float]:
    with torch.inference_mode():
        return sc._forward(PrefixRunner(sc.body, [], pad_id=sc.fill_id), ids, [16] * len(ids))


def _time(sc: dpo.DpoScorer, ids: list[list[int]]) -> float:
    t = time.perf_counter()
    _pass(sc, ids)
    return time.perf_counter() - t


def run(quick: bool = False, repeats: int = 3) -> list[dict]:
    """One row per (stand-in, shape): own and blocked seconds and peaks, ratio, score difference."""
    shapes = [(8, 200), (1, 2048), (1, 8192)] if not quick else [(4, 100), (1, 1024)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, over in STANDINS.items():
            folder = make_btlm_checkpoint(Path(tmp) / label.split()[0], max_length=8192, config_overrides=over)
            sc = _scorer(folder)
            choice = None
            for batch, length in shapes:
                ids = _ids(sc, batch, length)
                own_s, blk_s = float("inf"), float("inf")
                for _ in range(repeats):  # interleaved: drift on a shared machine hits both sides
                    if choice is not None:
                        choice.restore()
                    own_s = min(own_s, _time(sc, ids))
                    choice = attention.install(sc.name, sc.body)
                    assert choice.kind == "blocked", choice.reason
                    blk_s = min(blk_s, _time(sc, ids))
                blocked = _pass(sc, ids)
                blk_peak = peak_of(lambda: _pass(sc, ids))
                choice.restore()
                own = _pass(sc, ids)
                own_peak = peak_of(lambda: _pass(sc, ids))
                choice = None
                diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(own, blocked))
                rows.append({"standin": label, "batch": batch, "length": length, "own_s": own_s, "blocked_s": blk_s,
                             "ratio": blk_s / own_s, "own_peak": own_peak, "blocked_peak": blk_peak, "rel_diff": diff})
                print(f"  {label} {batch} x {length}: own {own_s:.3f} s, blocked {blk_s:.3f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The printed table, with the short-input target marked."""
    out = [f"{'stand-in':28s} {'shape':>9s} {'own s':>8s} {'blocked s':>9s} {'ratio':>6s} {'own peak':>10s} "
           f"{'blk peak':>10s} {'max rel diff':>12s}  target"]
    for r in rows:
        short = r["length"] <= attention.ATTENTION_BLOCK
        mark = (f"<= {TARGET_SHORT}x: {'met' if r['ratio'] <= TARGET_SHORT else 'NOT met'}" if short
                else "(what it is)")
        out.append(f"{r['standin']:28s} {r['batch']:>3d} x {r['length']:<5d}{r['own_s']:>8.3f} {r['blocked_s']:>9.3f} "
                   f"{r['ratio']:>5.2f}x {r['own_peak'] / MiB:>7.1f} MiB {r['blocked_peak'] / MiB:>6.1f} MiB "
                   f"{r['rel_diff']:>12.1e}  {mark}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes only (seconds)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    text = table(run(args.quick, args.repeats))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
