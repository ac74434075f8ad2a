"""The operator's INFO lines: each model at startup, one line per step, INFO by default in the CLI."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from rewardstack.cli import main
from rewardstack._memory.budget import weights_bytes
from rewardstack._stepobservers import revision_of
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
    assert revision_of("org/model", None, [lin]) == "the hub's default branch (not locked: rewardstack download pins it)"


def test_a_model_of_several_local_folders_is_logged_as_local(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # relevance_filter loads two folders (`paths`, no `path`): its line said "at unpinned" (issue 34 #8).
    from types import SimpleNamespace

    from rewardstack._stepobservers import log_models

    folders = [tmp_path / "bert", tmp_path / "mpnet"]
    for f in folders:
        f.mkdir()
    lin = torch.nn.Linear(2, 2)
    scorer = SimpleNamespace(modules=lambda: [lin], attention_info=lambda: "")
    cfg = SimpleNamespace(path="", paths=[str(f) for f in folders], revision=None)
    stack = SimpleNamespace(scorers={"relevance_filter": scorer}, config=SimpleNamespace(models={"relevance_filter": cfg}))
    with caplog.at_level(logging.INFO, logger="rewardstack"):
        log_models(stack)  # type: ignore[arg-type]
    assert "at local folders," in caplog.text and "unpinned" not in caplog.text, caplog.text


@pytest.mark.parametrize(("flags", "level"), [([], logging.INFO), (["-v"], logging.DEBUG), (["-q"], logging.WARNING)])
def test_cli_logs_rewardstack_at_info_by_default(flags: list[str], level: int, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    root, logger = logging.getLogger(), logging.getLogger("rewardstack")
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh process (pytest's own handlers aside)
    before, root_before = logger.level, root.level
    try:
        with warnings.catch_warnings():  # -q turns other libraries' Python warnings off: keep that local
            assert main([*flags, "config", "--explain"]) == 0
        assert logger.level == level
        # other libraries: warnings only; -q: their errors only
        assert root.level == (logging.ERROR if "-q" in flags else logging.WARNING)
    finally:
        logger.setLevel(before)
        root.setLevel(root_before)
        hf_logging.set_verbosity_warning()


def test_cli_keeps_a_callers_logging(capsys: pytest.CaptureFixture) -> None:
    logger = logging.getLogger("rewardstack")
    before = logger.level
    assert logging.getLogger().handlers  # pytest's: a caller that configured logging itself
    assert main(["config", "--explain"]) == 0
    assert logger.level == before


def test_step_line_shows_the_peak_of_the_calls_inside(caplog: pytest.LogCaptureFixture) -> None:
    # The step itself never enters the tracker; its model calls do (as the memory manager runs them).
    from types import SimpleNamespace

    from rewardstack._memory.device import TensorBytesTracker
    from rewardstack._stepobservers import OperatorLog

    tracker = TensorBytesTracker(budget_bytes=64 * 2**20)
    stack = SimpleNamespace(device=torch.device("cpu"), memory=SimpleNamespace(tracker=tracker), steps_scored=1)
    observer = OperatorLog()
    with caplog.at_level(logging.INFO, logger="rewardstack"):
        observer.step_started(stack, "augment")  # type: ignore[arg-type]
        with tracker:  # one call: 4 MiB of activations, freed before the step ends
            x = torch.ones(2**20, dtype=torch.float32)
            del x
        observer.step_ended(stack)  # type: ignore[arg-type]
        observer.step_scored(stack, SimpleNamespace(statuses=["ok"]))  # type: ignore[arg-type]
    [msg] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert msg.endswith("memory peak 4.0 MiB"), msg
