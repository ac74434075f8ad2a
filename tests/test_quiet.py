"""No false alarms: warnings whose cause rewardstack handles are silenced; an ordinary run prints none."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest

from rewardstack.cli import main
from rewardstack._quiet import silence_moot_warnings
from service_fixtures import one_reward_model_toml


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def test_long_text_tokenized_prints_no_length_warning(standins: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoTokenizer

    silence_moot_warnings()
    # transformers' verbosity is process-wide: a test before this one may have run `-q` in process.
    caplog.set_level(logging.WARNING, logger="transformers")
    tok = AutoTokenizer.from_pretrained(str(standins / "rlhf_reward_model"))
    tok.model_max_length = 512  # as the OpenAssistant scorer bounds it
    ids = tok(" ".join(["word"] * 3 * tok.model_max_length))["input_ids"]
    assert len(ids) > tok.model_max_length
    assert _warnings(caplog) == []
    logging.getLogger("transformers.tokenization_utils_base").warning("another warning still shows")
    assert _warnings(caplog) == ["transformers.tokenization_utils_base: another warning still shows"]


def test_btlm_generation_warning_is_silenced(caplog: pytest.LogCaptureFixture) -> None:
    from rewardstack._planning.btlm.modeling_btlm import BTLMLMHeadModel

    silence_moot_warnings()
    BTLMLMHeadModel.can_generate()
    assert _warnings(caplog) == []


def test_an_ordinary_run_prints_no_warning(standins: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           caplog: pytest.LogCaptureFixture) -> None:
    # A completion longer than the model's 512 tokens (cut by the scorer: `truncated`), no budget, no OOM.
    config = standins / "quiet-one-model.toml"
    config.write_text(one_reward_model_toml(tmp_path / "state", diversity=False))
    steps = tmp_path / "steps.jsonl"
    long = " ".join(f"word{i}" for i in range(1500))
    steps.write_text(json.dumps({"name": "augment", "prompt": "Ask a question.",
                                 "completions": ["What is a river?", long]}) + "\n")
    out = tmp_path / "events.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["score", "--config", str(config), "--input", str(steps), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and json.loads(out.read_text())["statuses"] == ["ok", "truncated"]
    noisy = [ln for ln in err.splitlines() if "WARNING" in ln or "[transformers]" in ln or "Warning" in ln]
    assert noisy == [] and _warnings(caplog) == [] and [str(w.message) for w in caught] == []
