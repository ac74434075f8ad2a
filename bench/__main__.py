"""`python -m bench`: every figure operators adopt rewardstack for, from one run, in one table.

On the same heavy-tailed workload (9 steps x 50 completions, one of 40,000 characters) and the same
stand-in weights:
1. throughput of the full default stack: rewardstack, the literal per-completion reference (on a
   subset of steps), `transformers.pipeline` for the classifiers, and the forward-pass floor;
   and per model the cost model's prediction error over the same workload (`bench.prediction`);
2. DPO on both stand-ins (the tiny vocabulary-bound one and the proportioned one) with its floor
   and floor-plus-head rows;
3. start-up: process start to first score, cold (profiling every model), warm (saved cost models)
   and the floor's (imports, plain `from_pretrained` of the same models, one pass each);
4. memory against input length (measured on the stand-ins; the real models at full size simulated);
5. memory at rest against uptime, and step time against completions per step;
6. rows on the real checkpoints, when scripts/fetch-real-models.sh has fetched them (`bench.real`:
   relevance and diversity on the real all-mpnet-base-v2, DPO on SmolLM2-135M, each against its
   floor, and memory against length); `--real-only` runs just these and rewrites just their section;
7. the trainer routes (`bench.trainers`): 64 one-sample `/get_reward` clients batched against one
   request at a time, a validator's step latency alone and while they send, telemetry on and off;
8. the trainer routes on a realistic reward model (`bench.trainer_floor`: a Llama-architecture
   model, chat texts of 100-500+ tokens) against OpenRLHF's own serve_rm.py and the model's floor,
   three shapes, and a validator under a trainer flood; `--trainer-floor-only` runs just these and
   rewrites just their section.
9. a trainer's burst (`bench.burst`): 4,096 simultaneous one-sample requests on `rewardstack serve`,
   on Ray Serve with 1 and 2 replicas and on OpenRLHF's serve_rm.py: drain time, peak RSS, refusals.
10. calibration under load (`bench.calibration`): a realistic reward model's pass size timed while
   every core is busy, then scoring on the quiet machine against a quiet calibration.
11. the same input, the same reward (`bench.invariance`): MKL's strict mode and fixed-shape passes
   against neither, on a realistic Llama reward model, for three trainer shapes.
It prints the table, marks each target met or not, and writes `bench/RESULTS.md` with three PNG
plots (`bench/results/`). `--quick` runs every row on tiny shapes in about two minutes and writes
only to `--out` (a temporary folder by default), never over the committed results. `--smoke` is the
test suite's run (tests/test_bench.py): one tiny row of each kind on the tiny stand-ins (one step of
three completions, DPO on the tiny stand-in alone with a 128-token calibration, a one-model
start-up, one length, the real rows on one step with a short DPO calibration); its figures mean
nothing, it proves that every row's code runs and writes its table, RESULTS.md and plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import burst, calibration, causal, curves, fullstack, invariance, prediction, results, trainer_floor, trainers
from bench.common import MiB, own_home
from tests.soak.synthetic import heavy_tailed_steps

HERE = Path(__file__).resolve().parent
TARGET_FLOOR = 1.2
TARGET_FLOOR_WITH_STARTUP = 1.35
REPEATS = 3  # interleaved runs of each step, the stack's and the floor's: single runs moved a ratio by 40% here


def _first_score_seconds(argv: list[str]) -> float:
    """Seconds from starting `python -m <argv>` to its `FIRST_SCORE` line, timed from outside."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=HERE.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE.parent / 'src'}"})
    line = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("FIRST_SCORE"):
            break
    elapsed = time.perf_counter() - t
    proc.wait()
    if not line.startswith("FIRST_SCORE"):
        raise RuntimeError(f"start-up probe {argv[0]} failed: {proc.stderr.read() if proc.stderr else ''}")
    return elapsed


def startup(config: Path, names: list[str], *, runs: int = 1) -> dict[str, float]:
    """Seconds from process start to the first score: rewardstack cold (profiling) and warm (saved
    cost models), and the floor (imports, plain `from_pretrained` of the same models, one pass
    each: `bench.floor_start`). Warm and floor: the fastest of `runs` fresh processes each, run
    interleaved; cold: one."""
    probes = {
        "cold": ["bench.first_score", str(config), "--recalibrate"],
        "warm": ["bench.first_score", str(config)],
        "floor": ["bench.floor_start", str(config), *names],
    }
    out = {label: float("inf") for label in probes}
    for k in range(runs):
        for label, argv in probes.items():
            if label == "cold" and k:  # no target rests on the cold start, and each costs ~25 s
                continue
            out[label] = min(out[label], _first_score_seconds(argv))
    return out


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every row on tiny shapes (~2 min); never overwrites bench/RESULTS.md")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: one tiny row of each kind on the tiny stand-ins (figures mean nothing); "
                         "never overwrites bench/RESULTS.md")
    ap.add_argument("--out", help="folder for RESULTS.md and the plots (default: bench/ for a full run, a temp folder for --quick)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="device for the stack")
    ap.add_argument("--uptime-steps", type=int, default=400, help="short steps for the memory-at-rest curve")
    ap.add_argument("--real-only", action="store_true",
                    help="only the rows on the real checkpoints (bench.real), written into their section of RESULTS.md")
    ap.add_argument("--trainer-floor-only", action="store_true",
                    help="only the trainer routes on the realistic reward model (bench.trainer_floor), written into "
                         "their section of RESULTS.md")
    args = ap.parse_args(argv)
    if args.real_only or args.trainer_floor_only:
        return _section_only(Path(args.out) if args.out else HERE, "real" if args.real_only else "trainer-floor")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    t_all = time.perf_counter()
    smoke = args.smoke
    q = args.quick or smoke
    fullstack.TINY = smoke
    if smoke:
        steps = heavy_tailed_steps(1, 3, long_chars=600, prompt_chars=100)
    else:
        steps = heavy_tailed_steps(2, 6, long_chars=3_000) if q else heavy_tailed_steps()
    heavy = max(range(len(steps)), key=lambda k: max(len(c or "") for c in steps[k].completions))
    ref_idx = [0] if q else sorted({0, 1, heavy})
    out_dir = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="bench-quick-")) if q else HERE)
    plots = out_dir / "results"
    plots.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t_all:6.0f} s] {name}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp, own_home(Path(tmp) / "home"):
        root = Path(tmp)
        stage("full stack: rewardstack, reference, pipelines, floor")
        # 1. full stack
        st = fullstack.measure(root, steps, ref_idx, device=args.device, repeats=1 if q else REPEATS)
        stage("prediction error per model (the same workload, tracker on)")
        pred_rows = prediction.measure(root, steps)
        stage("DPO on both stand-ins")
        dpo_rows: list[list[str]] = []
        prop = {"n_embd": 128, "n_layer": 2, "n_head": 2} if q else {"n_embd": 512, "n_layer": 8, "n_head": 8}
        dpo_idx = ref_idx if q else [k for k in range(len(steps)) if k != heavy][:2]
        # --smoke: no chunk tuning, a short profile (the stand-ins' 8k bound profiles for a minute
        # each) and the tiny stand-in alone (the proportioned one runs the same code on other shapes)
        dpo_opts = {"calibration_length": 128, "tune_logits_chunk": False} if smoke else None
        dpos = [causal.bench_dpo(root, "tiny CI stand-in", None, steps, ref_idx if q else list(range(len(steps))), dpo_rows,
                                 peaks=not q, options=dpo_opts)]
        if not smoke:
            dpos.append(causal.bench_dpo(root, "proportioned stand-in", prop, steps, dpo_idx, dpo_rows, peaks=False,
                                         options=dpo_opts))
        stage("start-up: cold, warm and the floor (fresh processes)")
        if smoke:  # one model: the probes' code, without loading the whole stack three times
            su = startup(_one_model_config(root / "standins" / "stack.toml"), ["rlhf_reward_model"], runs=1)
        else:
            su = startup(root / "standins" / "stack.toml", list(st.floor_s), runs=1 if q else 3)
        stage("memory against length")
        stack = fullstack.build_stack(root, device=args.device)
        lengths = (500,) if smoke else (500, 2_000) if q else curves.LENGTHS
        length_rows = curves.memory_vs_length(stack, lengths)
        stage("memory against uptime, step time against completions (a fresh stack)")
        stack = fullstack.build_stack(root, device=args.device)
        up = curves.memory_vs_uptime(stack, 4 if smoke else 12 if q else args.uptime_steps, 2 if smoke else 5 if q else 50)
        sizes = (2, 4) if smoke else (5, 10) if q else (10, 25, 50, 100, 200)
        scaling = curves.step_time_vs_completions(stack, sizes, repeats=1 if q else 2)
        del stack
        stage("trainer routes: batched against one at a time, a mixed load, telemetry on and off")
        if smoke:  # five servers started and loaded: minutes the suite's smoke run does not spend
            trainer_lines = ["trainer routes: not run in --smoke (`python -m bench.trainers`)"]
        else:
            trainer_lines = trainers.measure(*((16, 2, 3, 1) if q else (64, 6, 12, 3)), standins=root / "standins")
        stage("trainer routes on a realistic reward model: rewardstack, OpenRLHF's serve_rm.py, the floor")
        if smoke:  # three servers and the realistic model: tests/test_bench.py runs the section alone, tiny
            trainer_lines += ["", "realistic reward model: not run in --smoke (`python -m bench --trainer-floor-only`)"]
        else:
            quick = {"clients": 16, "multi_size": 16, "big": 32, "flood_clients": 8, "steps": 6} if q else {}
            trainer_lines += [""] + _trainer_floor_lines(64 if q else 512, 1 if q else 3, standins=root / "standins",
                                                         **quick)
        stage("a trainer's burst: rewardstack serve, Ray Serve with 1 and 2 replicas, serve_rm.py")
        if smoke:  # four servers, two of them on a Ray started for the row
            burst_lines = ["burst: not run in --smoke (`python -m bench.burst`)"]
        else:
            burst_lines = burst.measure(256 if q else 4096, device=args.device.split(":")[0])
        stage("calibration under load: timed with every core busy, then scoring on the quiet machine")
        if smoke:  # busy-loop processes on every core: not in the suite's run
            calibration_lines = ["calibration under load: not run in --smoke (`python -m bench.calibration`)"]
        else:
            calibration_lines = calibration.measure(64, 1, tiny=True) if q else calibration.measure()
        stage("the same input, the same reward: strict mode and fixed shapes against neither")
        if smoke:  # four servers of a realistic model: minutes the suite's smoke run does not spend
            invariance_lines = ["the same input, the same reward: not run in --smoke (`python -m bench.invariance`)"]
        else:
            invariance_lines = invariance.measure(1 if q else 3, 16 if q else 256, quick=q)

    # -- the table -------------------------------------------------------------------------------
    say(f"rewardstack benchmark, {dt.date.today().isoformat()}; {results.machine()}")
    say(f"workload: {len(steps)} steps x {len(steps[0].completions)} completions, heavy-tailed, one of "
        f"{max(len(c or '') for s in steps for c in s.completions):,} characters; reference on steps {ref_idx}")
    say(f"ours and the floor: per step, the fastest of {1 if q else REPEATS} interleaved runs each, summed (same statistic both sides); "
        "the reference and the pipelines: one run; start-ups: warm and floor the fastest of 3 fresh processes, cold one")
    say()
    head = ["model", "ours c/s", "reference c/s", "floor c/s", "ours / floor"]
    table = fullstack.rows(st)
    say(f"{head[0]:<26}" + "".join(f"{h:>15}" for h in head[1:]))
    for r in table:
        say(f"{r[0]:<26}" + "".join(f"{c:>15}" for c in r[1:]))
    speedup = (st.n_ref / st.stack_ref_subset_s) / (st.n_ref / st.ref_total) if st.ref_total else float("nan")
    say(f"speed-up over the per-completion reference (same steps): {speedup:.1f}x")
    if st.pipeline_s:
        pipe_n = st.n
        say(f"classifiers: rewardstack {pipe_n / st.ours_classifiers_s:.1f} c/s vs transformers.pipeline (batch 16) "
            f"{pipe_n / sum(st.pipeline_s.values()):.1f} c/s")
    say()
    for line in prediction.lines(pred_rows, None):
        say(line)
    ratio = st.stack_s / st.floor_total
    # Start-up counts on both sides: rewardstack's warm start against the floor's (the imports and
    # the plain loading of the same checkpoints, which no program scoring with them can skip).
    ratio_su = (st.stack_s + su["warm"]) / (st.floor_total + su["floor"])
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    say()
    say(f"start-up to first score: cold (profiling) {su['cold']:.1f} s, warm (saved cost models) {su['warm']:.1f} s, "
        f"floor (imports, from_pretrained, one pass per model) {su['floor']:.1f} s; "
        f"share of a {len(steps)}-step run: cold {su['cold'] / (su['cold'] + st.stack_s):.0%}, "
        f"warm {su['warm'] / (su['warm'] + st.stack_s):.0%}")
    say(f"TARGET full stack / floor (scoring) <= {TARGET_FLOOR}x: {ratio:.2f}x {met(ratio <= TARGET_FLOOR)}")
    say(f"TARGET full stack incl. warm start-up / floor incl. its start-up <= {TARGET_FLOOR_WITH_STARTUP}x: {ratio_su:.2f}x "
        f"{met(ratio_su <= TARGET_FLOOR_WITH_STARTUP)}")
    say()
    say("DPO on both stand-ins:")
    say(f"{'run':52s} {'n':>5s} {'secs':>8s} {'compl/s':>9s} {'peak MiB':>9s}  note")
    for r in dpo_rows:
        say(" ".join(r[:5]) + ("  " + r[5] if r[5] else ""))
    for d in dpos:
        say(f"  {d['label']}: {d['shape']}; vs floor (body) {d['vs_floor']:.2f}x, vs floor + head {d['vs_floor_head']:.2f}x, "
            f"speed-up vs reference {d['speedup_vs_ref']:.1f}x")
    say()
    say("memory against completion length (one completion; MiB):")
    say(f"{'model':<26}{'chars':>9}{'ours':>10}{'reference':>12}{'full-size ours (sim)':>22}{'full-size ref (sim)':>21}")
    for r in length_rows:
        ref = fmt_bytes(r.ref_bytes) if r.ref_bytes is not None else "not run"
        say(f"{r.model:<26}{r.chars:>9,}{fmt_bytes(r.ours_bytes):>10}{ref:>12}"
            f"{fmt_bytes(r.sim_ours_bytes):>22}{fmt_bytes(r.sim_ref_bytes) if r.sim_ref_bytes is not None else 'not simulated':>21}")
    say("  (full-size ref: rlhf untruncated as the reference ran it; the others at their bound, the same pass as ours;"
        " DPO's own reference pass, full [L, V] logits, is not simulated)")
    say()
    say(f"memory at rest over {len(up['live'])} steps: tracked live {up['live'][0] / MiB:.1f} -> {up['live'][-1] / MiB:.1f} MiB, "
        f"RSS {up['rss'][0] / MiB:.0f} -> {up['rss'][-1] / MiB:.0f} MiB; diversity history full at step {up['history_full_at']}; "
        f"from step {up['slope_from']} on: tracked slope {up['live_slope'] / 1024:.2f} KiB/step, RSS slope {up['rss_slope'] / 1024:.1f} KiB/step")
    per = [t / n for n, t in scaling]
    say("step time against completions per step: " + ", ".join(f"{n}: {t:.2f} s" for n, t in scaling)
        + f"; per completion {per[0] * 1000:.1f} -> {per[-1] * 1000:.1f} ms ({'linear or better' if per[-1] <= per[0] * 1.1 else 'worse than linear'})")
    stage("rows on the real checkpoints")
    real_lines = _real_lines(1 if q else 2, 1 if smoke else 2 if q else None, smoke=smoke)
    say()
    for line in real_lines:
        say(line)
    say()
    for line in trainer_lines:
        say(line)
    say()
    for line in burst_lines:
        say(line)
    say()
    for line in calibration_lines:
        say(line)
    say()
    for line in invariance_lines:
        say(line)
    wall = time.perf_counter() - t_all
    say(f"bench wall time {wall / 60:.1f} min")

    results.plot_length(length_rows, plots / "memory_vs_length.png")
    results.plot_uptime(up, plots / "memory_vs_uptime.png")
    results.plot_scaling(scaling, plots / "step_time_vs_completions.png")
    _write_markdown(out_dir / "RESULTS.md", lines, q, smoke=smoke)
    print(f"\nwrote {out_dir / 'RESULTS.md'} and {plots}/*.png")
    return 0


def _one_model_config(config: Path) -> Path:
    """A copy of the stand-ins' config with OpenAssistant alone (weight 1) and every mask off, beside it."""
    import tomllib

    data = tomllib.loads(config.read_text(encoding="utf-8"))
    lines = [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in data.items() if not isinstance(v, dict)]
    for name, entry in data["models"].items():
        lines.append(f"[models.{name}]")
        for k, v in entry.items():
            if k == "weight":
                v = 1.0 if name == "rlhf_reward_model" else 0.0
            elif k == "enabled":
                v = False
            lines.append(f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)))
        if "weight" not in entry and "enabled" not in entry and name != "rlhf_reward_model":
            lines.append("enabled = false")
    out = config.with_name("one-model.toml")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def _real_lines(repeats: int, n_steps: int | None = None, *, smoke: bool = False) -> list[str]:
    """bench.real's rows, or one line saying why they did not run (the checkpoints are not fetched)."""
    from bench import real
    from bench.realmodels import RealModelsError

    try:
        return real.measure(repeats, n_steps, smoke=smoke)
    except RealModelsError as e:
        return [f"real checkpoints: not run ({e})"]


SECTIONS = {"real": ("Real checkpoints", "--real-only"),
            "trainer-floor": ("Trainer routes on a realistic reward model", "--trainer-floor-only")}
"""The sections a flag runs alone and writes into RESULTS.md between `<!-- key -->` and `<!-- /key -->`."""


def _trainer_floor_lines(*args: Any, **kwargs: Any) -> list[str]:
    """bench.trainer_floor's rows, or one line saying why they did not run (no real tokenizer fetched)."""
    from bench.realmodels import RealModelsError

    try:
        return trainer_floor.measure(*args, **kwargs)
    except RealModelsError as e:
        return [f"realistic reward model: not run ({e})"]


def _section_only(out_dir: Path, key: str) -> int:
    """`--real-only` (bench.real's rows) or `--trainer-floor-only` (bench.trainer_floor's): print the
    rows and put them in their section of RESULTS.md."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    t = time.perf_counter()
    title, flag = SECTIONS[key]
    lines = [f"rewardstack benchmark, {title[0].lower() + title[1:]}, {dt.date.today().isoformat()}; {results.machine()}",
             *(_real_lines(2) if key == "real" else _trainer_floor_lines())]
    lines.append(f"wall time {(time.perf_counter() - t) / 60:.1f} min")
    for line in lines:
        print(line, flush=True)
    path = out_dir / "RESULTS.md"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    begin, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    section = "\n".join([begin, f"## {title}", "", f"From `python -m bench {flag}` (or the full run); the table as printed:",
                         "", "```", *lines, "```", end])
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + section + rest.split(end, 1)[1]
    elif "<!-- reading -->" in old:
        head, rest = old.split("<!-- reading -->", 1)
        new = head + section + "\n\n<!-- reading -->" + rest
    else:
        new = old.rstrip() + "\n\n" + section + "\n"
    path.write_text(new, encoding="utf-8")
    print(f"\nwrote the {key} rows into {path}")
    return 0


def _write_markdown(path: Path, lines: list[str], quick: bool, *, smoke: bool = False) -> None:
    """RESULTS.md: the printed table verbatim, the plots, and the reading (kept from the last edit)."""
    reading_marker = "<!-- reading -->"
    reading = ""
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if reading_marker in old:
            reading = old.split(reading_marker, 1)[1].strip()
    body = [
        "# Benchmark results" + (" (smoke run: figures mean nothing)" if smoke else " (quick dry run)" if quick else ""),
        "",
        "Regenerated by `python -m bench` (CPU, offline stand-ins). The table as printed:",
        "",
        "```",
        *lines,
        "```",
        "",
        "![memory against length](results/memory_vs_length.png)",
        "",
        "![memory against uptime](results/memory_vs_uptime.png)",
        "",
        "![step time against completions per step](results/step_time_vs_completions.png)",
        "",
        reading_marker,
        reading or "_Reading: to be written after looking at the plots._",
        "",
    ]
    path.write_text("\n".join(body), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
