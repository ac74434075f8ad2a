"""The soak's summary reads in plain words with units (issue 34 #8).

A short soak printed "0.0 steps/s per run" (a run slower than a step a second rounds to nothing)
and "after a warm-up of 3 steps and 0 of each process"; the memory range had no unit.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.soak.comparison import memory_slope
from tests.soak.verdict import format_verdict

MIB = 1024**2


def _rest_log(path: Path, steps: int) -> Path:
    """One process's rest log: tracked bytes and RSS per committed step, the history never full."""
    path.write_text("".join(json.dumps({"pid": 7, "steps": k, "rest_bytes": 40 * MIB + k, "rss_bytes": 900 * MIB + 1024 * k,
                                        "history_rows": 5 * k}) + "\n" for k in range(1, steps + 1)))
    return path


def _verdict(memory: dict, seconds: float, steps: int) -> dict:
    comparison = {"oom_statuses": 0, "events": steps, "expected": steps, "missing": 0, "duplicates": 0, "in_order": True,
                  "mismatched_values": 0, "rebatched_values": 0, "rebatched_by_model": {}, "rebatched_max_diff": 0.0,
                  "unexplained_exclusions": 0, "normalizers_equal": True, "max_normalizer_diff": 0.0, "mismatches": []}
    ooms = {"injected": 2, "real": 0, "recovered": 2, "split": 2, "cpu_fallback": 0, "gave_up": 0, "reported": 0}
    return {"passed": True, "failures": [], "steps": steps, "completions_per_step": 4, "input_errors": 0,
            "completions": {"ok": 4 * steps}, "ooms": ooms, "kills": 1, "restarts": 1, "crashes": 0,
            "memory": {**memory, "max_slope": 1024.0, "max_rss_slope": 65536.0}, "comparison": comparison,
            "seconds": seconds, "steps_per_second": steps / seconds}


def test_a_short_slow_soak_reads_in_plain_words(tmp_path: Path) -> None:
    memory = memory_slope(_rest_log(tmp_path / "rest.jsonl", 8), 8)
    basis = memory["basis"]
    assert "and 0 of each process" not in basis and "from step 4 on" in basis, basis
    text = format_verdict(_verdict(memory, seconds=200.0, steps=8))
    assert "0.0 steps/s" not in text and "25.0 s a step" in text, text
    assert "200 s in all" in text and "40.0 MiB" in text, text  # the tracked range, with its unit


def test_a_long_soak_names_each_process_warm_up(tmp_path: Path) -> None:
    basis = memory_slope(_rest_log(tmp_path / "rest.jsonl", 300), 300)["basis"]
    assert "each process's first 20 steps left out" in basis, basis
    text = format_verdict(_verdict(memory_slope(_rest_log(tmp_path / "r2.jsonl", 300), 300), seconds=100.0, steps=300))
    assert "3.0 steps a second" in text, text
