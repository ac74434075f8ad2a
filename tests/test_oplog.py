"""The operator's INFO lines: each model at startup, one line per step, INFO by default in the CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rewardstack.cli import main
from rewardstack.memory.budget import weights_bytes
from rewardstack.oplog import revision_of
from rewardstack.stack import RewardStack


def test_one_info_line_per_step_with_time_statuses_and_peak(fake_config, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    stack = RewardStack(fake_config)
    with caplog.at_level(logging.INFO, logger="rewardstack"):
        stack.score_step({"name": "augment", "prompt": "p", "completions": ["one answer", None, "two answers"]})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("step 1 augment: 3 completions in ") and "failed 1, ok 2" in line
    assert "memory peak" in line


def test_model_lines_name_revision_dtype_bytes_and_device(fake_config, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    with caplog.at_level(logging.INFO, logger="rewardstack"):
        stack = RewardStack(fake_config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model ")]
    assert {ln.split(":")[0].removeprefix("model ") for ln in lines} == set(stack.scorers)


def test_weights_bytes_and_revision() -> None:
    lin = torch.nn.Linear(4, 3).half()
    tied = torch.nn.Sequential(lin, lin)
    assert weights_bytes([tied, lin]) == (12 + 3) * 2  # a shared tensor counts once
    assert revision_of("x/y", "501f895", [lin]) == "501f895"
    assert revision_of(str(Path(__file__).parent), None, [lin]) == "local folder"
    assert revision_of("org/model", None, [lin]) == "unpinned"


@pytest.mark.parametrize(("flags", "level"), [([], logging.INFO), (["-v"], logging.DEBUG), (["-q"], logging.WARNING)])
def test_cli_logs_rewardstack_at_info_by_default(flags: list[str], level: int, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    root, logger = logging.getLogger(), logging.getLogger("rewardstack")
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh process (pytest's own handlers aside)
    before, root_before = logger.level, root.level
    try:
        assert main([*flags, "config", "--explain"]) == 0
        assert logger.level == level
        assert root.level == logging.WARNING  # other libraries: warnings only
    finally:
        logger.setLevel(before)
        root.setLevel(root_before)


def test_cli_keeps_a_callers_logging(capsys: pytest.CaptureFixture) -> None:
    logger = logging.getLogger("rewardstack")
    before = logger.level
    assert logging.getLogger().handlers  # pytest's: a caller that configured logging itself
    assert main(["config", "--explain"]) == 0
    assert logger.level == before
