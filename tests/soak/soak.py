"""The soak: weeks of traffic in an afternoon, with injected OOMs, kills and restarts.

    python -m tests.soak --config C --steps N [--completions 50] [--budget B] [--faults RATE] [--kills K]
                         [--run-dir D] [--seed S] [--pathological] [--max-slope BYTES] [--max-rss-slope BYTES]
                         [--threads T] [--rejudge D] [--service [--clients 4] [--timeout S]]

The command wires four parts together:

1. the workload (`tests.soak.workload`): N generated steps written to `D/steps.jsonl`;
2. the supervisor (`tests.soak.supervisor`): the faulted run (`D/faulted/`: injected OOMs
   at RATE inside real forward passes, K SIGKILLs at random moments, restarts until every step is
   committed) and, side by side, the clean run (`D/clean/`: one uninterrupted, fault-free process);
3. the comparison (`tests.soak.comparison`): events once and in order, values, exclusions,
   normalizer statistics; memory at rest fitted per process;
4. the verdict (`tests.soak.verdict`): printed and written to `D/summary.json` (key `soak`).

Exit 0 only if nothing was lost or duplicated, no value moved, no process crashed, every kill
landed and memory at rest did not grow; else 1. `--service` soaks the HTTP service instead
(`tests.soak.service_soak`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from rewardstack._cli_errors import run_command
from rewardstack._fileio import merge_json_section

from tests.soak.supervisor import finish, new_run_dir

NO_KILLS = {"kills": 0, "restarts": 0, "crashes": 0, "kill_points": []}
DEFAULT_MAX_SLOPE = 1024.0
"""Tracked bytes at rest: growth per step above which the soak fails (docs/REPLAY.md says why)."""
DEFAULT_MAX_RSS_SLOPE = 16 * 1024.0
"""Resident set: growth per step above which the soak fails (docs/REPLAY.md says why)."""


def cmd_soak(args: argparse.Namespace) -> int:
    """The `soak` command."""
    if args.service:
        from tests.soak.service_soak import cmd_service_soak

        return cmd_service_soak(args)
    if args.rejudge:
        return rejudge(Path(args.rejudge), args)
    from rewardstack.config import load_config
    from rewardstack._memory.manager import check_device
    from tests.soak.supervisor import spawn, supervise
    from tests.soak.workload import soak_steps, write_steps

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
    from tests.soak.comparison import EventIndex, compare, iter_events, memory_slope
    from tests.soak.verdict import format_verdict, judge
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


def build_parser() -> argparse.ArgumentParser:
    """The soak's flags."""
    s = argparse.ArgumentParser(prog="python -m tests.soak", description="generated traffic with injected OOMs, kills "
                                "and restarts, compared with a clean run (docs/REPLAY.md)")
    s.add_argument("--config", required=True, help="stack config (TOML)")
    s.add_argument("--steps", type=int, required=True, help="steps to run")
    s.add_argument("--completions", type=int, default=50, help="completions per step (default 50)")
    s.add_argument("--budget", help="memory budget: bytes or a size such as 24GiB (CPU: simulated device)")
    s.add_argument("--faults", type=float, default=0.0, help="share of forward passes that get an injected OOM (0.1 = 10%%)")
    s.add_argument("--kills", type=int, default=0, help="times the supervisor SIGKILLs the scoring process (the server with --service) and restarts it")
    s.add_argument("--run-dir", help="folder for the soak's files and summary.json (default: a new folder soak-<time> under $REWARDSTACK_HOME/<config stem>-<hash>/runs)")
    s.add_argument("--seed", type=int, default=0, help="seed of the workload, the faults and the kill moments")
    s.add_argument("--pathological", action="store_true", help="mix pathological inputs into the steps (tests.soak.pathological)")
    s.add_argument("--max-slope", type=float, default=DEFAULT_MAX_SLOPE,
                   help=f"tracked memory-at-rest growth, bytes per step, above which the soak fails (default {DEFAULT_MAX_SLOPE:g})")
    s.add_argument("--max-rss-slope", type=float, default=DEFAULT_MAX_RSS_SLOPE,
                   help=f"resident-set growth, bytes per step, above which the soak fails (default {DEFAULT_MAX_RSS_SLOPE:g})")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each scoring process (default 1: the faulted "
                                                          "and clean runs run side by side)")
    s.add_argument("--rejudge", metavar="RUN_DIR", help="compare and judge a finished soak's files again (nothing is "
                                                        "scored; --config, --kills and --faults as it ran)")
    s.add_argument("--service", action="store_true", help="soak `rewardstack serve` over loopback instead: clients with "
                                                          "numbered steps and retries, the server SIGKILLed --kills times")
    s.add_argument("--clients", type=int, default=4, help="--service: concurrent clients, one namespace each (default 4)")
    s.add_argument("--timeout", type=float, default=60.0, help="--service: seconds a request may take before the client "
                                                               "retries it (default 60)")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tests.soak`: an ordinary mistake ends in one line, as `rewardstack`'s commands do."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:  # rewardstack's INFO lines, other libraries' warnings (as `rewardstack`)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("rewardstack").setLevel(logging.INFO)
    return run_command(cmd_soak, args)
