"""Benchmark: the decoders' two paths, shared-prefix KV cache against the full-sequence fallback.

Run: `.venv/bin/python -m bench.decoder_paths [--quick] [--completions N] [--prompt-chars C]`.
On one step (a prompt of C characters and N completions of heavy-tailed length) it scores with
DPO and Reciprocate on their native stand-ins twice, once on the cache path and once forced onto
the fallback (as a model without cache objects runs), and DPO on the BTLM-like remote-code
stand-in (which the load probe sends to the fallback). It prints, per row: seconds per step,
completions/s, peak tracked tensor bytes, the fallback's time and peak as ratios of the cache
path's in the same run, and the largest score difference between the two paths (they must agree).

Timings on a shared machine are noise; read the ratios, on a quiet one.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import MiB, peak_of, timed
from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager
from rewardstack._scorers import dpo, kvcache, reciprocate
from rewardstack._scorers.base import Runtime, ScoreRequest
from rewardstack._scorers.loading import ModelCache
from rewardstack._standins import make_btlm_checkpoint, make_dpo_standin, make_reciprocate_standin
from tests.soak.synthetic import text


def _runtime() -> Runtime:
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu))


def _build(module: Any, name: str, path: Path, *, fallback: bool, trust: bool = False) -> Any:
    options = {"tune_logits_chunk": False} if module is dpo else {}
    cfg = ModelConfig(name=name, path=str(path), weight=1.0, dtype="float32", trust_remote_code=trust, options=options)
    if not fallback:
        return module.build(cfg, _runtime())
    real = kvcache.takes_cache_objects
    kvcache.takes_cache_objects = lambda body, vocab: (False, "forced by the benchmark")  # type: ignore[assignment]
    try:
        return module.build(cfg, _runtime())
    finally:
        kvcache.takes_cache_objects = real  # type: ignore[assignment]


def _step(n: int, prompt_chars: int) -> ScoreRequest:
    rng = random.Random(0)
    lengths = [int(min(3000, rng.paretovariate(1.3) * 60)) for _ in range(n)]
    return ScoreRequest(text(rng, prompt_chars), [text(rng, k) for k in lengths])


def _measure(scorer: Any, req: ScoreRequest) -> tuple[float, int, list[float]]:
    scores = scorer.score(req).scores  # warm-up, and the numbers
    seconds = min(timed(lambda: scorer.score(req)) for _ in range(2))
    return seconds, peak_of(lambda: scorer.score(req)), scores


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 completions, short prompt (a smoke run)")
    p.add_argument("--completions", type=int, default=50)
    p.add_argument("--prompt-chars", type=int, default=2000)
    args = p.parse_args(argv)
    n, chars = (8, 400) if args.quick else (args.completions, args.prompt_chars)
    req = _step(n, chars)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_dpo_standin(root / "gpt2")
        make_reciprocate_standin(root / "gptj")
        make_btlm_checkpoint(root / "btlm", max_length=2048)
        cases = [
            ("DPO, GPT-2 stand-in", dpo, "dpo_reward_model", root / "gpt2", False),
            ("Reciprocate, GPT-J stand-in", reciprocate, "reciprocate_reward_model", root / "gptj", False),
        ]
        for label, module, name, path, trust in cases:
            fast = _measure(_build(module, name, path, fallback=False, trust=trust), req)
            slow = _measure(_build(module, name, path, fallback=True, trust=trust), req)
            diff = max(abs(a - b) for a, b in zip(fast[2], slow[2]))
            rows.append((label, "cache", fast, None, None))
            rows.append((label, "fallback", slow, slow[0] / fast[0], (slow[1] / fast[1]) if fast[1] else float("nan"), diff))
        btlm = _build(dpo, "dpo_reward_model", root / "btlm", fallback=False, trust=True)
        assert not btlm.use_prefix, "the load probe should send the tuple-cache model to the fallback"
        rows.append(("DPO, BTLM-like remote code", "fallback (probe)", _measure(btlm, req), None, None))
    print(f"\none step: {n} completions, prompt {chars} characters (CPU; timings on a busy machine are noise)\n")
    print(f"{'scorer':<30} {'path':<17} {'s/step':>8} {'compl/s':>8} {'peak MiB':>9} {'time x':>7} {'peak x':>7} {'max |diff|':>11}")
    for row in rows:
        label, path, (sec, peak, _), tx, px = row[:5]
        diff = row[5] if len(row) > 5 else None
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{label:<30} {path:<17} {sec:8.3f} {n / sec:8.1f} {peak / MiB:9.1f} {fmt(tx, '7.2f'):>7} "
              f"{fmt(px, '7.2f'):>7} {fmt(diff, '11.2e'):>11}")


if __name__ == "__main__":
    main()
