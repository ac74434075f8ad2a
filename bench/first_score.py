"""Start-up probe: a fresh process that builds the stack from a config and scores one step.

`python -m bench.first_score CONFIG [--recalibrate]` prints `FIRST_SCORE <seconds since the
interpreter started>` once the first step is scored, then exits. The parent (`python -m bench`)
also times it from the outside (process start to that line), which includes the interpreter and
the imports, as an operator's restart pays them.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--recalibrate", action="store_true", help="profile every model (ignore saved cost models)")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack, Step

    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.state_dir = tmp
        kwargs = {}
        if "recalibrate" in inspect.signature(RewardStack).parameters:
            kwargs["recalibrate"] = args.recalibrate
        stack = RewardStack(cfg, **kwargs)
        stack.score_step(Step(name="augment", prompt="What is a reward model?", base_prompt="What is a reward model?",
                              completions=["A model that scores completions.", "It ranks answers."]), save=False)
        elapsed = time.time() - process_started()
        print(f"FIRST_SCORE {elapsed:.3f}", flush=True)


def process_started() -> float:
    """This process's start time (Linux: from /proc), seconds since the epoch."""
    import os

    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
