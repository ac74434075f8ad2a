"""The `rewardstack` command line: thin wrappers over the library.

    rewardstack score --config C --input STEPS.jsonl --output EVENTS.jsonl
    rewardstack demo [--dir DIR]
    rewardstack make-standins DIR
    rewardstack serve --config C [--host 127.0.0.1] [--port 8000]
    rewardstack serve --reward-model PATH_OR_HUB_ID@REV [--dtype D] [--max-length N] [--port 8000]
    rewardstack plan --reward-model PATH_OR_HUB_ID@REV --device-memory 80GiB
    rewardstack config --explain | --config C
    rewardstack download --config C
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from rewardstack._argtypes import positive_int
from rewardstack._modelflags import add_model_flags
from rewardstack._models import DTYPES
from rewardstack import _paths as paths


def cmd_score(args: argparse.Namespace) -> int:
    """Score a JSONL file of validator steps into a JSONL file of events, exactly once (rewardstack._runner)."""
    from rewardstack._cli_errors import check_folder, check_input_file, check_output_file
    from rewardstack._runner import run_score

    args.run_dir = paths.run_dir_for(args.run_dir, args.config, "score")  # a bare --run-dir: a new one in the home
    check_input_file(args.input)  # ordinary mistakes found before any model loads
    check_output_file(args.output)
    check_folder(args.run_dir, "--run-dir")
    return run_score(args)


def cmd_report(args: argparse.Namespace) -> int:
    """Plots and a one-page summary of a run directory (rewardstack._telemetry.report)."""
    from rewardstack._cli_errors import check_run_folder
    from rewardstack._telemetry.report import cmd_report as run

    check_run_folder(args.run_dir)
    return run(args)


def cmd_make_standins(args: argparse.Namespace) -> int:
    """Build the offline stand-in models and their config."""
    from rewardstack._standins import make_standins

    path = make_standins(args.dir, force=args.force, dpo=args.dpo)
    print(f"stand-in stack written; config: {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Will this stack fit a card of this size? (rewardstack._planning.plan; torch loads only now)"""
    from rewardstack._planning.plan import cmd_plan as run

    return run(args)


def _fmt(x: float) -> str:
    return "  nan" if not math.isfinite(x) else f"{x:5.3f}"


def summarize(event: dict[str, Any]) -> str:
    """A readable per-step summary: one row per completion, the best one marked."""
    from rewardstack.config import MASKS, REWARD_MODELS

    rewards = event["rewards"]
    rows = [f"step '{event['name']}': {len(rewards)} completions, scored in {event['step_length']:.2f}s"]
    active_r = [n for n in REWARD_MODELS if n in event["model_statuses"]]
    active_m = [n for n in MASKS if n in event["model_statuses"]]
    short = {n: n.split("_")[0][:6] for n in active_r + active_m}
    header = "    reward  status     " + " ".join(f"{short[n]:>6}" for n in active_r + active_m) + "  completion"
    rows.append(header)
    for i, c in enumerate(event["completions"]):
        cols = [f"{_fmt(event[n + '_normalized'][i]):>6}" for n in active_r]
        cols += [f"{event[n + '_normalized'][i]:6.0f}" for n in active_m]
        text = (c[:48] + "...") if len(c) > 51 else c
        mark = "*" if c and c.strip() == event["best"] and rewards[i] == max(rewards) else " "
        rows.append(f"  {mark} {_fmt(rewards[i])}  {event['statuses'][i]:<10} " + " ".join(cols) + f"  {text!r}")
    return "\n".join(rows)


def cmd_demo(args: argparse.Namespace) -> int:
    """Build stand-ins if missing, score the packaged sample run, print a summary per step.

    Each run starts from a fresh state and saves none, so a second run prints the same rewards and
    the same best (a saved state would carry the normalizers and diversity history over)."""
    from rewardstack.config import load_config
    from rewardstack.errors import InputError
    from rewardstack.stack import RewardStack
    from rewardstack._runner import iter_steps
    from rewardstack._standins import make_standins

    home = Path(args.dir) if args.dir else paths.standins()
    print(f"stand-in models in {home} (built on first use)", file=sys.stderr)
    print("demo: a fresh state each run (normalizers and diversity history start empty; nothing is saved)",
          file=sys.stderr)
    config_path = make_standins(home)
    cfg = load_config(config_path)
    stack = RewardStack(cfg, load_state=False)
    sample = resources.files("rewardstack").joinpath("data/sample_steps.jsonl").read_text(encoding="utf-8")
    for _, step in iter_steps(sample.splitlines()):
        if isinstance(step, InputError):
            raise step
        print(summarize(stack.score_step(step, save=False).event))
        print()
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print every config key (--explain) and/or validate a config file with its lock file."""
    from rewardstack import _explain as explain

    if not args.explain and not args.config:
        print("rewardstack config: give --explain, --config C, or both", file=sys.stderr)
        return 2
    if args.explain:
        sys.stdout.write(explain.explain())
    if args.config:
        sys.stdout.write(explain.check(args.config))
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    """Resolve every hub id of a config to a commit, fetch the files, write the lock file."""
    from rewardstack.config import load_config
    from rewardstack._hub import download

    path, entries = download(load_config(args.config), include_off=args.all, fetch=not args.no_fetch)
    for e in entries:
        code = "  (runs its own code)" if e.trust_remote_code else ""
        print(f"{e.model}: {e.hub_id} {e.requested_revision or '(default branch)'} -> {e.commit}{code}")
    print(f"lock file written: {path}")
    return 0


def _bytes(text: str) -> int:
    from rewardstack.errors import ConfigError
    from rewardstack._settings import parse_bytes

    try:
        return parse_bytes(text, key="--device-memory")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


HOME_EPILOG = """\
where files go (docs/SCORING.md): everything a command is not told where to put lands
under $REWARDSTACK_HOME (default ~/.cache/rewardstack): standins/, plan-cache/, real/,
calibration/cache.json (fitted cost models keyed by checkpoint, unless [memory] calibration_file),
and one folder per config file, <config stem>-<hash>/ with state/ (unless the config states
state_dir) and runs/ (bare --run-dir)."""


def add_score_parser(sub: Any) -> None:
    """`rewardstack score`'s flags."""
    s = sub.add_parser("score", help="score validator steps (JSONL) into events (JSONL)")
    s.add_argument("--config", required=True, help="stack config (TOML)")
    s.add_argument("--input", required=True, help="one step per line: name, prompt, completions[, base_prompt, uids]")
    s.add_argument("--output", required=True, help="events, one per line ('-' for stdout)")
    s.add_argument("--save-every", type=positive_int, default=1, help="commit state and events every N steps (and at the end); a rerun resumes after the last commit")
    s.add_argument("--run-dir", nargs="?", const=paths.BARE_RUN_DIR, metavar="DIR",
                   help="write timeline.jsonl, events.jsonl, incidents/, summary.json here (docs/TELEMETRY.md); "
                        "bare --run-dir: a new folder score-<time> under $REWARDSTACK_HOME/<config stem>-<hash>/runs "
                        "(default: [telemetry] run_dir, else none)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT while scoring")
    s.add_argument("--device-memory", type=_bytes, help="behave as on a card of this size, e.g. 40GiB (overrides [memory] device_memory)")
    s.add_argument("--recalibrate", action="store_true", help="profile every model again instead of reading saved cost models")
    s.add_argument("--max-chars", type=positive_int, help="read at most this many characters of each prompt and "
                   "completion; a completion cut here gets status 'cut' (overrides [input] max_chars, default 65536)")
    s.add_argument("--max-completions", type=positive_int, help="refuse a step with more completions, as a bad "
                   "line (overrides [input] max_completions, default 256)")
    s.set_defaults(func=cmd_score)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `rewardstack` command."""
    p = argparse.ArgumentParser(prog="rewardstack", description=__doc__.splitlines()[0], epilog=HOME_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log more: -v rewardstack's debug lines, -vv every library's info and debug")
    p.add_argument("-q", "--quiet", action="count", default=0,
                   help="log less: -q rewardstack's warnings and errors only, other libraries' errors only "
                        "(the default logs rewardstack's INFO lines)")
    sub = p.add_subparsers(dest="command", required=True)

    add_score_parser(sub)

    d = sub.add_parser("demo", help="score a packaged sample run on offline stand-in models")
    d.add_argument("--dir", help="folder for the stand-ins (default $REWARDSTACK_HOME/standins)")
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("make-standins", help="build small random stand-in models and their config")
    m.add_argument("dir", help="output folder")
    m.add_argument("--force", action="store_true", help="rebuild even if the folder holds a stack")
    m.add_argument("--dpo", choices=("gpt2", "btlm"), default="gpt2",
                   help="DPO stand-in: a native GPT-2 (default) or the BTLM-like model that loads through its own remote code")
    m.set_defaults(func=cmd_make_standins)

    c = sub.add_parser("config", help="list every config key (--explain) or validate a config file")
    c.add_argument("--explain", action="store_true", help="print every key: type, default, one line of help")
    c.add_argument("--config", help="a config file to validate, with the lock file beside it")
    c.set_defaults(func=cmd_config)

    dl = sub.add_parser("download", help="pin every hub id of a config to a commit, fetch it, write the lock file")
    dl.add_argument("--config", required=True, help="stack config (TOML); the lock file is written beside it")
    dl.add_argument("--all", action="store_true", help="also the models that are off")
    dl.add_argument("--no-fetch", action="store_true", help="resolve and lock only; do not download files")
    dl.set_defaults(func=cmd_download)

    from rewardstack._service.command import add_parser as add_serve_parser  # imports no FastAPI

    add_serve_parser(sub)

    r = sub.add_parser("report", help="plots and a one-page summary (report.html) of a run directory")
    r.add_argument("run_dir", help="a run directory written by --run-dir")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")
    r.set_defaults(func=cmd_report)

    from rewardstack._distributed.commands import add_parsers as add_ray_parsers  # imports no Ray

    add_ray_parsers(sub)

    from rewardstack._replay.commands import add_parsers as add_replay_parsers

    add_replay_parsers(sub)

    pl = sub.add_parser("plan", help="will this stack fit a card of this size? (configs only, no weights, no GPU)")
    pl.add_argument("--config", default=None, help="stack config (default: the shipped default stack, or only "
                    "the --reward-model models)")
    add_model_flags(pl, dtype=False, device=False)  # plan's --dtype sets every model's, the [rewards.*] ones included
    pl.add_argument("--device-memory", default=None,
                    help="the card's memory, e.g. 24GiB, 40GiB, 80GiB (default: the config's [memory] device_memory)")
    pl.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="run every model in this dtype")
    pl.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    pl.add_argument("--no-cache", action="store_true", help="simulate everything again (default: reuse "
                    "$REWARDSTACK_HOME/plan-cache, shared by every config, keyed by the code and versions)")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rewardstack` command."""
    args = build_parser().parse_args(argv)
    # rewardstack's own lines at INFO by default (models, budget, placement, fits, one per step);
    # other libraries only warn unless -vv.
    # A program that set up logging before calling main() keeps its own configuration.
    if not logging.getLogger().handlers:
        v = args.verbose - args.quiet
        own = logging.DEBUG if v >= 1 else logging.INFO if v == 0 else logging.WARNING
        logging.basicConfig(level=logging.DEBUG if v >= 2 else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger("rewardstack").setLevel(own)
        if v < 0:
            from rewardstack._quiet import quiet_libraries

            quiet_libraries()  # -q: other libraries' warnings too
    from rewardstack._quiet import silence_moot_warnings
    from transformers.utils import logging as hf_logging

    silence_moot_warnings()  # warnings whose cause rewardstack already handles (rewardstack._quiet)

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars drown the output
    from rewardstack._cli_errors import run_command  # one line for an ordinary mistake; -v adds the traceback

    return run_command(args.func, args, verbose=args.verbose)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
