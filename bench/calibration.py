"""Benchmark: a calibration timed while every core is busy, then scoring on a quiet machine.

Run: `.venv/bin/python -m bench.calibration [--texts 256] [--rounds 3] [--smoke]`.
The model is a reward model of realistic proportions (a LlamaForSequenceClassification: 6 layers,
width 384, MLP 1536, 6 heads, one label, float32; built from a config and saved with
`save_pretrained`), served as `[rewards.realistic]`, on chat-like texts of 100-500 tokens. Rows:

- quiet calibration: a stack built in a home of its own on the quiet machine (its pass size timed
  then);
- loaded calibration: a stack built in another home while `os.cpu_count()` busy-loop processes
  hold every core (stopped once it has loaded);
- loaded cache, quiet restart: a third stack started on the quiet machine from the loaded one's
  calibration cache (the entry says it was timed busy: the pass size is timed again).

Then all three score the same texts on the quiet machine, in interleaved rounds (one group per
text, 64 groups a call, as the service batches one-sample trainer requests); each row's median
and best samples/s over the rounds. Target: the loaded calibration's median within 10% of the quiet
one's (ratio >= 0.9). `--smoke` runs a 1-layer, 64-wide model on 16 short texts, one round: its
figures mean nothing, it proves the code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from bench.common import own_home

TARGET_RATIO = 0.9
NAME = "realistic"
GROUPS_PER_CALL = 64


def _config(folder: Path, model: Path) -> Path:
    path = folder / "rewards.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(f'device = "cpu"\nstate_dir = "{folder / "state"}"\n\n[rewards.{NAME}]\npath = "{model}"\n',
                    encoding="utf-8")
    return path


def _stack(config: Path, home: Path) -> tuple[Any, dict[str, Any]]:
    """A stack built from `config` in `home`, and what its calibration did (pass tokens, seconds,
    whether it profiled, the timing record its cache entry keeps)."""
    from rewardstack import RewardStack
    from rewardstack import _paths as paths

    with own_home(home):
        t = time.perf_counter()
        stack = RewardStack.from_config(str(config), load_state=False)
        seconds = time.perf_counter() - t
        cache = json.loads(paths.calibration_file().read_text(encoding="utf-8"))
    name = f"rewards.{NAME}" if f"rewards.{NAME}" in stack.scorers else next(iter(stack.scorers))
    timing = next((e.get("timing") for e in cache["entries"].values() if e.get("name") == name), None)
    return stack, {"name": name, "pass_tokens": stack.scorers[name].max_tokens, "load_s": seconds,
                   "profiled": bool(stack.memory.profiled), "timing": timing or {}}


def _busy_cores() -> list[subprocess.Popen]:
    """One busy-loop process per core (the caller stops them)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _score_seconds(stack: Any, name: str, texts: list[str]) -> float:
    """Seconds to score `texts`, one group per text, `GROUPS_PER_CALL` groups a call."""
    scorer = stack.scorers[name]
    t = time.perf_counter()
    with stack.memory.serving():
        for k in range(0, len(texts), GROUPS_PER_CALL):
            scorer.score_groups([[(x, "query")] for x in texts[k:k + GROUPS_PER_CALL]])
    return time.perf_counter() - t


def measure(n_texts: int = 256, rounds: int = 3, *, tiny: bool = False) -> list[str]:
    """The table's lines (see the module's docstring); `tiny`: the 1-layer model on short texts."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from bench import realistic

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = realistic.build_model(root / "model", shape=realistic.TINY if tiny else None)
        texts = realistic.chat_texts(n_texts)
        config = _config(root / "cfg", model)
        quiet, q_info = _stack(config, root / "home-quiet")
        procs = _busy_cores()
        try:
            time.sleep(0.5)  # every busy loop running before the calibration starts
            loaded, l_info = _stack(config, root / "home-loaded")
        finally:
            _stop(procs)
        time.sleep(0.5)
        restart, r_info = _stack(config, root / "home-loaded")
        rows = [("quiet calibration", quiet, q_info), ("loaded calibration", loaded, l_info),
                ("loaded cache, quiet restart", restart, r_info)]
        times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
        for _, stack, info in rows:
            _score_seconds(stack, info["name"], texts[:8])  # first-call costs out of the rounds
        for r in range(rounds):
            for label, stack, info in rows[r % len(rows):] + rows[:r % len(rows)]:  # each order in turn
                times[label].append(_score_seconds(stack, info["name"], texts))
    return _lines(rows, times, n_texts, rounds, tiny)


def _lines(rows: list[tuple[str, Any, dict[str, Any]]], times: dict[str, list[float]], n: int, rounds: int,
           tiny: bool) -> list[str]:
    from bench import realistic
    from bench.results import machine

    rate = {label: (n / statistics.median(ts), n / min(ts)) for label, ts in times.items()}
    base = rate[rows[0][0]][0]
    out = [f"calibration under load ({time.strftime('%Y-%m-%d')}; {machine()})",
           f"model: the realistic Llama reward model {realistic.TINY if tiny else realistic.SHAPE}, float32; "
           f"{n} chat texts (bench.realistic); "
           f"{os.cpu_count()} busy-loop processes during the loaded calibration; {rounds} interleaved scoring rounds",
           f"{'row':<30}{'pass tokens':>12}{'cpu share':>11}{'timed':>7}{'load s':>8}{'median s/s':>12}"
           f"{'best s/s':>10}{'ratio':>7}"]
    for label, _, info in rows:
        share = info["timing"].get("cpu_share")
        median, best = rate[label]
        out.append(f"{label:<30}{info['pass_tokens']:>12}{'-' if share is None else f'{share:.2f}':>11}"
                   f"{'yes' if info['profiled'] else 'no':>7}{info['load_s']:>8.1f}{median:>12.1f}{best:>10.1f}"
                   f"{median / base:>7.2f}")
    ratio = rate[rows[1][0]][0] / base
    out.append(f"TARGET loaded calibration / quiet calibration (median samples/s) >= {TARGET_RATIO}: {ratio:.2f} "
               f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=256, help="texts scored per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved scoring rounds")
    ap.add_argument("--smoke", action="store_true",
                    help="a 1-layer model, 16 short texts, one round (figures mean nothing)")
    args = ap.parse_args(argv)
    lines = measure(16, 1, tiny=True) if args.smoke else measure(args.texts, args.rounds)
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
