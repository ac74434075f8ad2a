"""`rewardstack soak`: weeks of traffic in an afternoon, with injected OOMs, kills and restarts.

    rewardstack soak --config C --steps N [--completions 50] [--budget B] [--faults RATE] [--kills K]
                     [--run-dir D] [--seed S] [--pathological] [--max-slope BYTES] [--max-rss-slope BYTES]
                     [--threads T]

The command wires four parts together:

1. the workload (`rewardstack._replay.workload`): N generated steps written to `D/steps.jsonl`;
2. the supervisor (`rewardstack._replay.supervisor`): the faulted run (`D/faulted/`: injected OOMs
   at RATE inside real forward passes, K SIGKILLs at random moments, restarts until every step is
   committed) and, side by side, the clean run (`D/clean/`: one uninterrupted, fault-free process);
3. the comparison (`rewardstack._replay.comparison`): events once and in order, values, exclusions,
   normalizer statistics; memory at rest fitted per process;
4. the verdict (`rewardstack._replay.verdict`): printed and written to `D/summary.json` (key `soak`).

Its flags are registered in `rewardstack._replay.commands`.

Exit 0 only if nothing was lost or duplicated, no value moved, no process crashed, every kill
landed and memory at rest did not grow; else 1. `rewardstack soak --service` soaks the HTTP service
instead (`rewardstack._replay.service_soak`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rewardstack._fileio import merge_json_section
from rewardstack._replay.supervisor import finish, new_run_dir

NO_KILLS = {"kills": 0, "restarts": 0, "crashes": 0, "kill_points": []}


def cmd_soak(args: argparse.Namespace) -> int:
    """The `soak` command."""
    if args.service:
        from rewardstack._replay.service_soak import cmd_service_soak

        return cmd_service_soak(args)
    if args.rejudge:
        return rejudge(Path(args.rejudge), args)
    from rewardstack.config import load_config
    from rewardstack._memory.manager import check_device
    from rewardstack._replay.supervisor import spawn, supervise
    from rewardstack._replay.workload import soak_steps, write_steps

    check_device(load_config(args.config).device)  # fails here, clearly, before any process starts
    run_dir = new_run_dir(args, "soak")
    started = time.time()
    steps = soak_steps(args.steps, args.completions, seed=args.seed, pathological=args.pathological)
    steps_path = run_dir / "steps.jsonl"
    bad_lines = write_steps(steps_path, steps, surrogate_every=10 if args.pathological else 0)
    expected = _expected_hashes(steps_path)
    chars = sorted(len(c or "") for s in steps for c in s.completions)
    del steps
    print(f"soak: {len(expected)} steps x {args.completions} completions (median {chars[len(chars) // 2]} chars, "
          f"longest {chars[-1]}), faults {args.faults:.0%}, kills {args.kills}, in {run_dir}", file=sys.stderr)

    # The clean run needs no supervision: it runs beside the faulted one, each on its own core.
    # It starts first, and the faulted run once it has calibrated: both then read one calibration
    # from the cache. Two processes calibrating at once may tune different logits chunks (a timing),
    # so different cost models and budget caps, and a long completion cut at a different token
    # (a 2026-12-03 soak under load: one DPO value -3.1e23 against -1.1e25, repetition compounding).
    ready = run_dir / "clean" / "ready"
    ready.unlink(missing_ok=True)
    clean_proc = spawn(args.config, steps_path, run_dir / "clean", faults=0.0, seed=args.seed, budget=args.budget,
                       tag="0", threads=args.threads, ready=ready)
    while not ready.exists() and clean_proc.poll() is None:
        time.sleep(0.05)
    sup = supervise(args, steps_path, run_dir / "faulted", len(expected))
    print(f"soak: faulted run done ({sup['kills']} kills, {sup['crashes']} crashes, {time.time() - started:.0f} s); "
          "waiting for the clean run...", file=sys.stderr)
    clean_sup = {**NO_KILLS, "crashes": int(clean_proc.wait() != 0)}
    seconds = round(time.time() - started, 1)
    verdict = judge_run(run_dir, args, expected, sup=sup, clean_sup=clean_sup, input_errors=bad_lines,
                        threads=args.threads, seconds=seconds, scoring_seconds=seconds)
    return 0 if verdict["passed"] else 1


def _expected_hashes(steps_path: Path) -> list[str]:
    from rewardstack._runner import iter_steps, step_hash
    from rewardstack.stack import Step

    with steps_path.open(encoding="utf-8") as f:
        return [step_hash(s) for _, s in iter_steps(f) if isinstance(s, Step)]


def judge_run(run_dir: Path, args: argparse.Namespace, expected: list[str], *, sup: dict[str, Any],
              clean_sup: dict[str, Any], **figures: Any) -> dict[str, Any]:
    """Compare a finished soak's files (`run_dir`) and judge them: printed and written to summary.json.

    `figures` (input_errors, threads, seconds, scoring_seconds) go into the verdict as given."""
    from rewardstack.config import REWARD_MODELS, load_config
    from rewardstack._replay.comparison import EventIndex, compare, iter_events, memory_slope
    from rewardstack._replay.verdict import format_verdict, judge
    from rewardstack._state import StateStore

    cfg = load_config(args.config)
    f_state_dir = run_dir / "faulted" / "state"
    f_state = StateStore(f_state_dir).load() if f_state_dir.exists() else {}
    active = [m for m in REWARD_MODELS if cfg.models[m].active]
    clean = EventIndex(run_dir / "clean" / "events.jsonl")
    cmp = compare(expected, iter_events(run_dir / "faulted" / "events.jsonl"), clean, f_state, active)
    ooms, statuses = cmp.pop("ooms"), cmp.pop("completions")
    memory = memory_slope(run_dir / "faulted" / "rest.jsonl", len(expected), reference=run_dir / "clean" / "rest.jsonl")
    clean_memory = memory_slope(run_dir / "clean" / "rest.jsonl", len(expected))
    scoring_seconds = figures["scoring_seconds"]
    verdict = judge(cmp=cmp, sup=sup, clean_sup=clean_sup, clean_events=clean.count, memory=memory, ooms=ooms,
                    clean_memory=clean_memory, statuses=statuses, kills_wanted=args.kills, faults=args.faults,
                    max_slope=args.max_slope, max_rss_slope=args.max_rss_slope, steps=len(expected),
                    completions_per_step=args.completions, budget=args.budget,
                    steps_per_second=len(expected) / scoring_seconds if scoring_seconds > 0 else 0.0, **figures)
    return finish(run_dir, "soak", verdict, format_verdict(verdict))


def rejudge(run_dir: Path, args: argparse.Namespace) -> int:
    """`soak --rejudge DIR`: the comparison and verdict again, on a finished soak's own files.

    For a change to the comparison's bounds: nothing is scored again. The supervisor's counts
    (kills, restarts, crashes, kill points), the wall time and the input errors are read from the
    verdict in DIR/summary.json, which is replaced; the run's first verdict is kept under
    `soak_before` (a second rejudge keeps that one, not its predecessor)."""
    summary = run_dir / "summary.json"
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
        before = data["soak"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"soak --rejudge: {summary} holds no soak verdict ({e})") from None
    if "soak_before" not in data:
        merge_json_section(summary, "soak_before", before)
    verdict = judge_run(run_dir, args, _expected_hashes(run_dir / "steps.jsonl"),
                        sup={k: before[k] for k in NO_KILLS}, clean_sup=NO_KILLS, input_errors=before["input_errors"],
                        threads=before["threads"], seconds=before["seconds"], scoring_seconds=before["scoring_seconds"])
    return 0 if verdict["passed"] else 1
