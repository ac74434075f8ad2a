"""The Python API loads as quietly as the CLI (issue 34 #8).

`RewardStack(load_config(...))` printed one transformers "Loading weights" progress bar per
checkpoint, which the CLI had always switched off. In a fresh process (a test process may have
switched the bars off already through `main()`), building the stack prints none, and the caller's
own setting is left as it was.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from transformers.utils import logging as hf_logging
from rewardstack import RewardStack, load_config

assert hf_logging.is_progress_bar_enabled()
RewardStack(load_config(sys.argv[1]), load_state=False)
print("bars after:", hf_logging.is_progress_bar_enabled())
"""


def test_building_a_stack_from_python_prints_no_progress_bars(tiny_standins: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_standins / "stack.toml")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Loading weights" not in done.stderr and "it/s]" not in done.stderr, done.stderr[-2000:]
    assert "bars after: True" in done.stdout  # the caller's choice stands
