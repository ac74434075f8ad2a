"""The card's whole account per step in the timeline, and the report's picture and tables of it."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from rewardstack.stack import RewardStack
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir, read_timeline

from telemetry_fixtures import EXTRA_BYTES, HOG, HogScorer, hog_config, step  # noqa: F401 - fixture

MIB = 1024**2


def test_step_records_carry_the_cards_account_and_the_report_draws_it(hog_config, tmp_path: Path,  # noqa: ANN001
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    weights = torch.nn.Linear(512, 512)  # 1 MiB + 2 KiB of float32 weights for the hog
    monkeypatch.setattr(HogScorer, "modules", lambda self: [weights])
    HogScorer.extra_on_call = 2  # 64 MiB more in the second call: the first step's activation peak
    HogScorer.max_batch = 1
    stack = RewardStack(hog_config(memory_budget=256 * MIB), load_state=False)
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    for k in range(3):
        stack.score_step(step(k), save=False)
    mon.close()
    cards = [r["card"] for r in read_timeline(tmp_path / "run") if r["type"] == "step"]
    assert len(cards) == 3
    w = (512 * 512 + 512) * 4
    assert all(c["weights"][HOG] == {"state": "resident", "bytes": w, "counted_bytes": w, "shared_with": []}
               and c["weights_on_card"] == w for c in cards)
    # CPU without device_memory: no card size; memory_budget is the weight budget and the activation budget
    assert all(c["capacity"] is None and c["weight_budget"] == 256 * MIB and c["activation_budget"] == 256 * MIB
               and c["source"] == "tracker" for c in cards)
    base = statistics.median(c["activation_peak"] for c in cards)
    assert abs(cards[0]["activation_peak"] - base - EXTRA_BYTES) <= 0.05 * EXTRA_BYTES  # the hog's step
    assert cards[0]["reserved"] == cards[0]["allocated"] and cards[0]["fragmentation"] == 0

    from rewardstack._telemetry.report import write_report

    page, _ = write_report(tmp_path / "run")
    assert (page.parent / "card_over_steps.png").stat().st_size > 10_000
    text = page.read_text()
    assert "Placement and swaps" in text and "Per step" in text and "Top inputs per model" in text
    assert text.count("<tr><td>") >= 1 + 3 + 1  # a model row, three step rows, a top input


def test_calibration_shows_per_model_progress(hog_config, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import tqdm

    bars: list[dict] = []
    real = tqdm.tqdm

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            super().__init__(*a, **k)
            bars.append({"desc": k.get("desc"), "total": self.total, "names": []})

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            bars[-1]["names"].append(s)
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    RewardStack(hog_config(), load_state=False)
    [bar] = [b for b in bars if b["desc"] == "calibrating"]
    assert bar["total"] >= 1 and HOG in bar["names"]
