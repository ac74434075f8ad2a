"""`rewardstack soak`: weeks of traffic in an afternoon, with injected OOMs, kills and restarts.

    rewardstack soak --config C --steps N [--completions 50] [--budget B] [--faults RATE] [--kills K]
                     [--run-dir D] [--seed S] [--pathological] [--max-slope BYTES]

1. Writes N generated steps (`soak_steps`: heavy-tailed lengths, median completion >= 200
   characters, one completion of >= 8,000 tokens every 50 steps; with `--pathological`, the kinds of
   `rewardstack.replay.pathological` mixed in, growing prompts, and lines with unpaired surrogates)
   to `D/steps.jsonl`.
2. A supervisor runs the scoring process (`python -m rewardstack.replay.soak worker`, the exactly-once
   loop of `rewardstack.runner` with a `FaultInjector` at RATE that raises OOMs inside real forward
   passes after their first allocations) and SIGKILLs it K times at random moments (after a random
   number of committed steps, plus a random fraction of a step, so mid-forward-pass too), restarting
   it each time with the same arguments until every step is committed (`D/faulted/`).
3. The same steps are scored again in one uninterrupted, fault-free process (`D/clean/`).
4. The comparison, within 1e-6: every step's event present exactly once and in order; every
   completion not reported `oom` has the clean run's raw values and status; a completion reported
   `oom` is excluded from the statistics and nothing else is; the final normalizer statistics equal
   the clean run's values folded over the same included completions. Memory at rest (tracker live
   bytes on CPU, allocated bytes on CUDA; after the diversity history is full when the run gets
   there, else after a warm-up) must not grow: least-squares slope, per process, below --max-slope
   bytes per step.

The verdict is printed and written to `D/summary.json` (key `soak`). Exit 0 only if nothing was
lost or duplicated, no process crashed and memory did not grow; else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rewardstack.config import MASKS, REWARD_MODELS
from rewardstack.stack import Step
from rewardstack.memory.snapshot import host_memory
from rewardstack.models import DIVERSITY, MODELS

TOL = 1e-6
REBATCH_TOL = 1e-5
"""A model's pass split after a recovered OOM runs its inputs in other batch shapes (other padding,
another float32 summation order): its values there may move by float32 batching noise, up to this
(relative, floor 1), and are counted apart; anything further is a failure."""
# Diversity embeds with relevance's second model (one checkpoint, one embedding cache per step): a
# split of that pass moves diversity's values by the same float32 batching noise.
SHARED_PASS = {m.embeds_with: m.name for m in MODELS if m.embeds_with}
LONG_EVERY = 50
LONG_CHARS = 50_000  # >= 8,000 tokens with the stand-ins' BERT tokenizer (about 10,000)
MAX_CRASHES = 3


# -- the workload ---------------------------------------------------------------------------------

def soak_steps(n: int, n_completions: int = 50, *, seed: int = 0, pathological: bool = False) -> list[Step]:
    """N validator steps: heavy-tailed lengths (median >= 200 chars), one very long completion every 50 steps."""
    from rewardstack.replay import pathological as path
    from rewardstack.workload import heavy_tailed_steps, text

    steps = heavy_tailed_steps(n, n_completions, seed=seed, long_chars=0)
    rng = random.Random(seed + 1)
    for s, step in enumerate(steps):
        if s % LONG_EVERY == min(10, n // 2):
            step.completions[rng.randrange(len(step.completions))] = text(rng, LONG_CHARS)
    if pathological:
        path.grow_prompts(steps)
        path.mix_into(steps, seed)
    return steps


def write_steps(path: Path, steps: list[Step], *, surrogate_every: int = 0) -> int:
    """Write the step JSONL; every `surrogate_every`-th step is followed by a bad line. Returns bad lines."""
    bad = 0
    with path.open("w", encoding="utf-8") as f:
        for s, step in enumerate(steps):
            f.write(json.dumps(step.to_dict(), ensure_ascii=False) + "\n")
            if surrogate_every and s % surrogate_every == surrogate_every - 1:
                from rewardstack.replay.pathological import surrogate_line

                f.write(surrogate_line(step) + "\n")
                bad += 1
    return bad


# -- the scoring process --------------------------------------------------------------------------

def _rest_bytes(stack: Any) -> int:
    """Memory at rest: the simulated device's live bytes (CPU) or the allocator's (CUDA)."""
    if stack.memory.tracker is not None:
        return int(stack.memory.tracker.live_bytes)
    import torch

    if stack.device.type == "cuda":  # pragma: no cover - CUDA-only path
        return int(torch.cuda.memory_allocated(stack.device))
    return 0


def _history_rows(stack: Any) -> int:
    state = getattr(stack, "state", None)
    hist = getattr(getattr(state, "diversity", None), "history", None)
    return int(hist.shape[0]) if hist is not None else 0


def worker(args: argparse.Namespace) -> int:
    """One scoring process of the soak: exactly-once `score` with injected OOMs; memory at rest logged."""
    from rewardstack.config import load_config
    from rewardstack.memory import FaultInjector
    from rewardstack.runner import score_file
    from rewardstack.settings import parse_bytes
    from rewardstack.stack import RewardStack
    from rewardstack.state import StateLock

    cfg = load_config(args.config)
    cfg.state_dir = args.state_dir
    if args.budget:
        cfg.memory_budget = parse_bytes(args.budget, key="--budget")
    with StateLock(cfg.state_dir):
        stack = RewardStack(cfg)
        if args.faults > 0:
            stack.memory.injector = FaultInjector(args.faults, seed=args.seed)
        seen = [stack.memory.oom_log[-1] if stack.memory.oom_log else None]
        rest = open(args.rest, "a", encoding="utf-8")

        def on_result(step: Step, result: Any) -> None:
            log = list(stack.memory.oom_log)
            new = []
            for rec in reversed(log):  # the records after the last one seen (the log may be bounded)
                if rec is seen[0]:
                    break
                new.append(rec)
            seen[0] = log[-1] if log else None
            # Committed with the event: OOM counts are exact per committed step, kills or not.
            result.event["soak_ooms"] = [{"model": r.model, "action": r.action, "injected": r.injected} for r in reversed(new)]
            rest.write(json.dumps({"pid": os.getpid(), "steps": stack.steps_scored, "rest_bytes": _rest_bytes(stack),
                                   "rss_bytes": host_memory()[0], "history_rows": _history_rows(stack)}) + "\n")
            rest.flush()

        report = score_file(stack, args.input, args.output, on_result=on_result, progress=False,
                            err=open(os.devnull, "w"))
        rest.close()
    print(f"worker {os.getpid()}: scored {report.scored}, resumed after {report.resumed}, redone {report.redone}",
          file=sys.stderr)
    return 0


# -- the supervisor -------------------------------------------------------------------------------

def _lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _spawn(cfg: str, steps: Path, folder: Path, *, faults: float, seed: int, budget: str | None, tag: str) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rewardstack.replay.soak", "worker", "--config", cfg, "--input", str(steps),
           "--output", str(folder / "events.jsonl"), "--state-dir", str(folder / "state"), "--rest", str(folder / "rest.jsonl"),
           "--faults", str(faults), "--seed", str(seed)]
    if budget:
        cmd += ["--budget", budget]
    log = open(folder / f"worker-{tag}.log", "w")
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def supervise(args: argparse.Namespace, steps_path: Path, folder: Path, n_steps: int) -> dict[str, Any]:
    """Run the faulted scoring process to the end, killing it `args.kills` times at random moments."""
    rng = random.Random(args.seed + 7)
    out = folder / "events.jsonl"
    # Kill points leave at least one step after them, so a kill within one step's time lands.
    room = range(1, max(2, n_steps - 1))
    targets = sorted(rng.sample(room, min(args.kills, len(room)))) if n_steps > 1 else []
    kills = restarts = crashes = 0
    kill_points: list[dict[str, Any]] = []
    step_seconds = 0.0
    while True:
        proc = _spawn(args.config, steps_path, folder, faults=args.faults, seed=args.seed + 1000 * restarts,
                      budget=args.budget, tag=str(restarts))
        if targets:
            target = targets[0]
            last_n, last_t = _lines(out), None  # the first commit of a process includes its start-up
            while proc.poll() is None and _lines(out) < target:
                time.sleep(0.05)
                n = _lines(out)
                if n > last_n:
                    now = time.time()
                    if last_t is not None:
                        # Average time per committed step (for a random moment inside the next one).
                        dt = (now - last_t) / (n - last_n)
                        step_seconds = dt if step_seconds == 0 else 0.8 * step_seconds + 0.2 * dt
                    last_n, last_t = n, now
            if proc.poll() is None:
                delay = rng.uniform(0.0, 0.9 * step_seconds) if step_seconds else rng.uniform(0.0, 0.3)
                time.sleep(delay)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    restarts += 1
                    kill_points.append({"after_committed": _lines(out), "delay_s": round(delay, 3)})
                    targets.pop(0)
                    continue
            targets.pop(0)  # it ended before the moment came: counted below
        rc = proc.wait()
        if rc == 0:
            break
        crashes += 1
        restarts += 1
        if crashes > MAX_CRASHES:
            break
    return {"kills": kills, "restarts": restarts, "crashes": crashes, "kill_points": kill_points}


# -- the comparison -------------------------------------------------------------------------------

def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def _same(a: Any, b: Any, tol: float = TOL) -> bool:
    x, y = _num(a), _num(b)
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= tol * max(1.0, abs(y))


def compare(expected_hashes: list[str], faulted: list[dict[str, Any]], clean: list[dict[str, Any]],
            faulted_state: dict[str, Any], active_rewards: list[str]) -> dict[str, Any]:
    """The soak's comparison of the faulted run against the clean one (see the module docstring)."""
    from rewardstack.normalize import RunningNormalizer

    got = [e.get("step_hash") for e in faulted]
    counts = Counter(got)
    duplicates = sum(c - 1 for c in counts.values() if c > 1)
    missing = sum(1 for h in expected_hashes if h not in counts)
    in_order = got == expected_hashes
    mismatched: list[dict[str, Any]] = []
    rebatched: list[float] = []
    unexplained: list[dict[str, Any]] = []
    oom_included: list[dict[str, Any]] = []
    folded = {m: RunningNormalizer() for m in active_rewards}
    by_hash = {e.get("step_hash"): e for e in clean}
    history_noise = False
    for pos, f in enumerate(faulted):
        c = by_hash.get(f.get("step_hash"))
        if c is None:
            continue
        raw = [r["model"] for r in f.get("soak_ooms", []) if r["action"] == "split"]
        split = {m.split("[", 1)[0] for m in raw} | {SHARED_PASS[m] for m in raw if m in SHARED_PASS}
        # Diversity compares each completion with the embeddings of earlier steps: noise from one
        # split stays in its history, so its values may carry it in every later step too.
        history_noise = history_noise or DIVERSITY.name in split
        if history_noise:
            split.add(DIVERSITY.name)
        for i, status in enumerate(f["statuses"]):
            if status == "oom":
                # Reported lost: its raw values must be out of the statistics (NaN), nothing else.
                if any(not math.isnan(_num(f[m][i])) for m in active_rewards if f["model_statuses"].get(m, [None] * (i + 1))[i] == "oom"):
                    oom_included.append({"step": pos, "index": i})
                continue
            for m in list(REWARD_MODELS) + list(MASKS):
                if _same(f[m][i], c[m][i]):
                    continue
                if m in split and _same(f[m][i], c[m][i], REBATCH_TOL):
                    rebatched.append(abs(_num(f[m][i]) - _num(c[m][i])))
                else:
                    mismatched.append({"step": pos, "index": i, "model": m, "faulted": f[m][i], "clean": c[m][i]})
            if status != c["statuses"][i]:
                mismatched.append({"step": pos, "index": i, "model": "status", "faulted": status, "clean": c["statuses"][i]})
        for m in active_rewards:
            included = [_num(c[m][i]) for i in range(len(f["statuses"])) if not math.isnan(_num(f[m][i]))]
            excluded_clean = [i for i in range(len(f["statuses"]))
                              if math.isnan(_num(f[m][i])) and not math.isnan(_num(c[m][i])) and f["statuses"][i] != "oom"
                              and f["model_statuses"].get(m, [""] * (i + 1))[i] != "oom"]
            unexplained += [{"step": pos, "index": i, "model": m} for i in excluded_clean]
            folded[m].update(included)
    norm_diff = 0.0
    norm_equal = True
    stored = faulted_state.get("normalizers", {})
    for m in active_rewards:
        want, have = folded[m], stored.get(m, {})
        if have.get("count") != want.count:
            norm_equal = False
        for key in ("mean", "var"):
            d = abs(float(have.get(key, math.nan)) - getattr(want, key))
            norm_diff = max(norm_diff, d) if not math.isnan(d) else math.inf
            if not d <= TOL * max(1.0, abs(getattr(want, key))):
                norm_equal = False
    return {
        "events": len(faulted), "expected": len(expected_hashes), "missing": missing, "duplicates": duplicates,
        "in_order": in_order, "mismatched_values": len(mismatched), "mismatches": mismatched[:10],
        "rebatched_values": len(rebatched), "rebatched_max_diff": max(rebatched, default=0.0),
        "unexplained_exclusions": len(unexplained), "oom_in_statistics": len(oom_included),
        "normalizers_equal": norm_equal, "max_normalizer_diff": norm_diff,
        "steps_in_state": faulted_state.get("stack", {}).get("steps_scored"),
    }


def _slope(points: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares slope of `key` against steps, pooled within each process (None: no data)."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for r in points:
        if r.get(key) is not None:
            by_pid.setdefault(r["pid"], []).append((float(r["steps"]), float(r[key])))
    if not by_pid:
        return None
    sxy = sxx = 0.0
    for xs in by_pid.values():
        mx = sum(x for x, _ in xs) / len(xs)
        my = sum(y for _, y in xs) / len(xs)
        sxy += sum((x - mx) * (y - my) for x, y in xs)
        sxx += sum((x - mx) ** 2 for x, _ in xs)
    return sxy / sxx if sxx > 0 else 0.0


def memory_slope(rest_path: Path, n_steps: int) -> dict[str, Any]:
    """Least-squares slope of memory at rest (bytes per step), pooled within each process."""
    from rewardstack.scorers.embedding import HISTORY_MAX

    recs = [json.loads(line) for line in rest_path.read_text().splitlines() if line.strip()] if rest_path.exists() else []
    full = [r for r in recs if r["history_rows"] >= HISTORY_MAX]
    if len(full) >= 20:
        pts, basis = full, "after the diversity history filled"
    else:
        warm = max(3, n_steps // 5)
        pts, basis = [r for r in recs if r["steps"] > warm], f"after a warm-up of {warm} steps (the history did not fill)"
    slope = _slope(pts, "rest_bytes") or 0.0
    rest = [r["rest_bytes"] for r in pts]
    rss = [r["rss_bytes"] for r in pts if r.get("rss_bytes") is not None]
    return {"slope_bytes_per_step": slope, "points": len(pts), "basis": basis,
            "rest_bytes_min": min(rest) if rest else None, "rest_bytes_max": max(rest) if rest else None,
            "rss_slope_bytes_per_step": _slope(pts, "rss_bytes"),
            "rss_bytes_min": min(rss) if rss else None, "rss_bytes_max": max(rss) if rss else None}


def cmd_soak(args: argparse.Namespace) -> int:
    """The `soak` command."""
    from rewardstack.fileio import jsonable as _jsonable
    from rewardstack.config import load_config
    from rewardstack.fileio import atomic_write_json as _write_json
    from rewardstack.runner import iter_steps, step_hash
    from rewardstack.state import StateStore

    cfg = load_config(args.config)  # fails here, clearly, before any process starts
    run_dir = Path(args.run_dir) if args.run_dir else Path("soak-runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    steps = soak_steps(args.steps, args.completions, seed=args.seed, pathological=args.pathological)
    steps_path = run_dir / "steps.jsonl"
    bad_lines = write_steps(steps_path, steps, surrogate_every=10 if args.pathological else 0)
    with steps_path.open(encoding="utf-8") as f:
        expected = [step_hash(s) for _, s in iter_steps(f) if isinstance(s, Step)]
    chars = sorted(len(c or "") for s in steps for c in s.completions)
    print(f"soak: {len(steps)} steps x {args.completions} completions (median {chars[len(chars) // 2]} chars, "
          f"longest {chars[-1]}), faults {args.faults:.0%}, kills {args.kills}, in {run_dir}", file=sys.stderr)

    sup = supervise(args, steps_path, run_dir / "faulted", len(expected))
    print(f"soak: faulted run done ({sup['kills']} kills, {sup['crashes']} crashes); clean run...", file=sys.stderr)
    clean_args = argparse.Namespace(**{**vars(args), "faults": 0.0, "kills": 0})
    clean_sup = supervise(clean_args, steps_path, run_dir / "clean", len(expected))

    faulted = _events(run_dir / "faulted" / "events.jsonl")
    clean = _events(run_dir / "clean" / "events.jsonl")
    f_state = StateStore(run_dir / "faulted" / "state").load() if (run_dir / "faulted" / "state").exists() else {}
    active = [m for m in REWARD_MODELS if cfg.models[m].active]
    cmp = compare(expected, faulted, clean, f_state, active)
    statuses = Counter(s for e in faulted for s in e["statuses"])
    oom_recs = [r for e in faulted for r in e.get("soak_ooms", [])]
    ooms = {
        "injected": sum(r["injected"] for r in oom_recs),
        "recovered": sum(r["action"] in ("split", "cpu_fallback") for r in oom_recs),
        "gave_up": sum(r["action"] == "gave_up" for r in oom_recs),
        "reported": statuses.get("oom", 0),
        "real": sum(not r["injected"] for r in oom_recs),
    }
    memory = memory_slope(run_dir / "faulted" / "rest.jsonl", len(expected))
    failures = []
    if cmp["missing"] or cmp["duplicates"] or not cmp["in_order"] or cmp["events"] != cmp["expected"]:
        failures.append(f"events: {cmp['events']} of {cmp['expected']}, {cmp['missing']} missing, {cmp['duplicates']} duplicated")
    if len(clean) != len(expected):
        failures.append(f"the clean run wrote {len(clean)} of {len(expected)} events")
    if cmp["mismatched_values"]:
        failures.append(f"{cmp['mismatched_values']} values differ from the clean run")
    if cmp["unexplained_exclusions"] or cmp["oom_in_statistics"]:
        failures.append(f"{cmp['unexplained_exclusions']} completions left out of the statistics without 'oom', "
                        f"{cmp['oom_in_statistics']} 'oom' completions counted")
    if not cmp["normalizers_equal"]:
        failures.append(f"normalizer statistics differ from the clean run's (largest difference {cmp['max_normalizer_diff']:.3g})")
    if cmp["steps_in_state"] != len(expected):
        failures.append(f"the state counts {cmp['steps_in_state']} steps for {len(expected)}")
    if sup["crashes"] or clean_sup["crashes"]:
        failures.append(f"{sup['crashes'] + clean_sup['crashes']} scoring process(es) crashed (see worker-*.log)")
    if sup["kills"] < args.kills:
        failures.append(f"only {sup['kills']} of {args.kills} kills landed (the run ended first)")
    if memory["slope_bytes_per_step"] > args.max_slope:
        failures.append(f"memory at rest grows {memory['slope_bytes_per_step']:.1f} bytes/step (limit {args.max_slope:g})")
    verdict = {
        "passed": not failures, "failures": failures, "steps": len(expected), "input_errors": bad_lines,
        "completions": dict(statuses), "ooms": ooms, "kills": sup["kills"], "restarts": sup["restarts"],
        "crashes": sup["crashes"] + clean_sup["crashes"], "kill_points": sup["kill_points"], "memory": memory,
        "comparison": cmp, "faults": args.faults, "completions_per_step": args.completions, "budget": args.budget,
        "seconds": round(time.time() - started, 1),
    }
    summary_path = run_dir / "summary.json"
    doc: dict[str, Any] = {}
    if summary_path.exists():
        try:
            doc = json.loads(summary_path.read_text())
        except ValueError:
            doc = {}
    doc["soak"] = _jsonable(verdict)
    _write_json(summary_path, doc)
    print(format_verdict(verdict))
    return 0 if verdict["passed"] else 1


def format_verdict(v: dict[str, Any]) -> str:
    """The verdict for a person."""
    c, o, m = v["comparison"], v["ooms"], v["memory"]
    rows = [
        f"soak verdict: {'PASS' if v['passed'] else 'FAIL'}",
        f"  steps {v['steps']} x {v['completions_per_step']} completions; input errors {v['input_errors']} (lines refused)",
        "  completions by status: " + ", ".join(f"{k} {n}" for k, n in sorted(v["completions"].items())),
        f"  OOMs injected {o['injected']} / recovered {o['recovered']} (split or host fallback) / gave up {o['gave_up']} "
        f"-> completions reported 'oom' {o['reported']} (real OOMs {o['real']})",
        f"  kills {v['kills']}, restarts {v['restarts']}, crashes {v['crashes']}",
        f"  memory at rest: slope {m['slope_bytes_per_step']:.2f} bytes/step over {m['points']} points ({m['basis']}); "
        f"range {m['rest_bytes_min']}..{m['rest_bytes_max']} bytes",
        f"  process RSS (reported, not judged: includes the allocator's caches): "
        + (f"slope {m['rss_slope_bytes_per_step']:.0f} bytes/step, range {m['rss_bytes_min'] / 2**20:.0f}.."
           f"{m['rss_bytes_max'] / 2**20:.0f} MiB" if m.get("rss_slope_bytes_per_step") is not None else "not measured"),
        f"  comparison with the clean run: events {c['events']}/{c['expected']}, missing {c['missing']}, duplicated "
        f"{c['duplicates']}, in order {c['in_order']}; values differing {c['mismatched_values']} (beyond {TOL:g}; "
        f"{c['rebatched_values']} more within float32 batching noise after a split, largest {c['rebatched_max_diff']:.2g}); "
        f"unexplained exclusions "
        f"{c['unexplained_exclusions']}; normalizers equal {c['normalizers_equal']} (max diff {c['max_normalizer_diff']:.3g})",
        f"  {v['seconds']} s",
    ]
    for mm in c["mismatches"][:5]:
        rows.append(f"    differs: step {mm['step']}, completion {mm['index']}, {mm['model']}: faulted {mm['faulted']!r}, "
                    f"clean {mm['clean']!r}")
    rows += [f"  FAILED: {f}" for f in v["failures"]]
    return "\n".join(rows)


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rewardstack.replay.soak worker")
    p.add_argument("--config", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--rest", required=True)
    p.add_argument("--faults", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return worker(args)


if __name__ == "__main__":  # the scoring process the supervisor starts
    if len(sys.argv) < 2 or sys.argv[1] != "worker":
        sys.exit("usage: python -m rewardstack.replay.soak worker ... (started by `rewardstack soak`)")
    sys.exit(_worker_main(sys.argv[2:]))
