"""A smoke run of `python -m bench --smoke`: one tiny row of each kind of the benchmark.

The bench itself is a command (`python -m bench`, `--quick` for its two-minute dry run); this test
proves that every row's code runs on the tiny stand-ins (and the real checkpoints, one step) and that
the table, RESULTS.md and the three plots are produced. Nothing about speed (speed is read from a
full run on a quiet machine, never from a test).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def process_logging() -> Iterator[None]:
    """The bench is a program and quiets logging for good (`logging.disable`, transformers' verbosity);
    run in this process, it must leave the tests after it the logging they started with."""
    from transformers.utils import logging as hf_logging

    disabled, verbosity, bars = logging.root.manager.disable, hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    yield
    logging.disable(disabled)
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


@pytest.mark.slow
def test_quick_benchmark_runs_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.__main__ import main

    committed = (ROOT / "bench" / "RESULTS.md").read_text() if (ROOT / "bench" / "RESULTS.md").exists() else None
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("whole stack", "TARGET full stack / floor", "start-up to first score", "DPO on both stand-ins",
                "memory against completion length", "memory at rest", "step time against completions per step"):
        assert row in out, row
    text = (tmp_path / "RESULTS.md").read_text()
    assert "smoke run" in text and "whole stack" in text
    # The real rows ran (the suite fetches the checkpoints; without them the bench says why instead).
    assert "dpo_reward_model (SmolLM2-135M" in out or "real checkpoints: not run" in out
    for png in ("memory_vs_length.png", "memory_vs_uptime.png", "step_time_vs_completions.png"):
        assert (tmp_path / "results" / png).stat().st_size > 10_000
    # --smoke never touches the committed results.
    now = (ROOT / "bench" / "RESULTS.md").read_text() if (ROOT / "bench" / "RESULTS.md").exists() else None
    assert now == committed
