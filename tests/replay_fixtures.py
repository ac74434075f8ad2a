"""Small realistic run logs for the replay tests: a validator's forward passes as loguru, parquet and JSONL."""

from __future__ import annotations

import gzip
import json
import math
import zipfile
from pathlib import Path
from typing import Any

NAN = math.nan

# Two forward passes as the validator logged them. Per-model raw values: rlhf and dpo ran (NaN where
# the call failed), dahoas was off (the validator logs zeros for it).
PASSES: list[dict[str, Any]] = [
    {"name": "augment", "prompt": "Tell me about rivers and how they shape valleys over time.",
     "completions": ["Rivers carve valleys by erosion.", "", "Water shapes land slowly.", "That is an excellent question."],
     "best": "Rivers carve valleys by erosion.",
     "rlhf": [0.5, NAN, 0.25, -1.0]},
    {"name": "followup0", "prompt": "Ask a question about: Rivers carve valleys by erosion.",
     "completions": ["How fast do rivers erode rock?", "What is a valley?", "", "Rivers carve valleys by erosion."],
     "best": "How fast do rivers erode rock?",
     # the empty completion here has a finite logged value: a real empty answer, scored as ""
     "rlhf": [1.5, 0.75, -2.0, 0.0]},
    {"name": "answer0", "prompt": "Answer: How fast do rivers erode rock?",
     "completions": ["A few millimetres a year.", "How fast do rivers erode rock?", "Slowly.", "It depends on the rock."],
     "best": "It depends on the rock.",
     "rlhf": [0.1, -0.2, 0.3, 0.9]},
    {"name": "followup1", "prompt": "Ask another question about: Rivers carve valleys by erosion.",
     "completions": ["How fast do rivers erode rock?", "Which rivers are oldest?", "Why do valleys widen?", ""],
     "best": "Which rivers are oldest?",
     "rlhf": [0.2, 1.1, 0.4, NAN]},
    {"name": "answer1", "prompt": "Answer: Which rivers are oldest?",
     "completions": ["It depends on the rock.", "The Finke river is among the oldest.", "Old ones.", "Nobody knows."],
     "best": "The Finke river is among the oldest.",
     "rlhf": [0.0, 1.2, -0.4, 0.1]},
    {"name": "augment", "prompt": "Summarize the history of paper making.",
     "completions": ["How fast do rivers erode rock?", "Paper came from China.", "Paper is made of pulp.", "It depends on the rock."],
     "best": "Paper came from China.",
     "rlhf": [0.3, 0.8, 0.6, 0.2]},
]

# What the spec says the validator built (written out by hand, not computed by the reader).
EXPECTED_BASES = [
    "Tell me about rivers and how they shape valleys over time.",
    "Rivers carve valleys by erosion.",
    "How fast do rivers erode rock?",
    "Rivers carve valleys by erosion.",
    "Which rivers are oldest?",
    "Summarize the history of paper making.",
]
# The equivalent steps, as `rewardstack score` reads them (failed calls are null).
EQUIVALENT_STEPS = [
    {"name": "augment", "prompt": PASSES[0]["prompt"], "base_prompt": EXPECTED_BASES[0],
     "completions": ["Rivers carve valleys by erosion.", None, "Water shapes land slowly.", "That is an excellent question."],
     "logged_best": "Rivers carve valleys by erosion."},
    {"name": "followup0", "prompt": PASSES[1]["prompt"], "base_prompt": EXPECTED_BASES[1],
     "completions": ["How fast do rivers erode rock?", "What is a valley?", "", "Rivers carve valleys by erosion."],
     "logged_best": "How fast do rivers erode rock?"},
    {"name": "answer0", "prompt": PASSES[2]["prompt"], "base_prompt": EXPECTED_BASES[2],
     "completions": PASSES[2]["completions"], "logged_best": "It depends on the rock."},
    {"name": "followup1", "prompt": PASSES[3]["prompt"], "base_prompt": EXPECTED_BASES[3],
     "completions": ["How fast do rivers erode rock?", "Which rivers are oldest?", "Why do valleys widen?", None],
     "logged_best": "Which rivers are oldest?"},
    {"name": "answer1", "prompt": PASSES[4]["prompt"], "base_prompt": EXPECTED_BASES[4],
     "completions": PASSES[4]["completions"], "logged_best": "The Finke river is among the oldest."},
    {"name": "augment", "prompt": PASSES[5]["prompt"], "base_prompt": EXPECTED_BASES[5],
     "completions": PASSES[5]["completions"], "logged_best": "Paper came from China."},
]


def event(p: dict[str, Any], block: int) -> dict[str, Any]:
    """The validator's event for one step (per-model values included, as openvalidators logs them)."""
    n = len(p["completions"])
    e: dict[str, Any] = {
        "name": p["name"], "block": block, "step_length": 1.25, "prompt": p["prompt"], "uids": list(range(10, 10 + n)),
        "completions": p["completions"], "completion_times": [0.5] * n, "rewards": [0.1] * n, "gating_loss": 0.01,
        "best": p["best"],
        "rlhf_reward_model": p["rlhf"], "rlhf_reward_model_normalized": [0.5 if math.isfinite(x) else 0.0 for x in p["rlhf"]],
        "dahoas_reward_model": [0.0] * n, "dahoas_reward_model_normalized": [0.0] * n,
        "blacklist_filter": [1.0] * n, "blacklist_filter_normalized": [1.0] * n,
    }
    return e


def loguru_line(extra: dict[str, Any], ts: float, level: str = "EVENTS", message: str = "events") -> str:
    """One line of loguru's `serialize=True` sink; `json.dumps` writes NaN bare, as the validator's did."""
    record = {
        "elapsed": {"repr": "0:01:02.000000", "seconds": 62.0}, "exception": None, "extra": extra,
        "file": {"name": "forward.py", "path": "/opt/openvalidators/forward.py"}, "function": "run_step",
        "level": {"icon": "", "name": level, "no": 38 if level == "EVENTS" else 20}, "line": 143, "message": message,
        "module": "forward", "name": "openvalidators.forward", "process": {"id": 4242, "name": "MainProcess"},
        "thread": {"id": 1, "name": "MainThread"}, "time": {"repr": f"2023-07-20 10:00:{int(ts) % 60:02d}", "timestamp": ts},
    }
    return json.dumps({"text": f"2023-07-20 | {level} | {message}\n", "record": record})


def write_rotated_log(folder: Path) -> Path:
    """A run folder: the oldest file zip-compressed, the next gzip-compressed, the live completions.log."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [loguru_line(event(p, 1000 + i), 1689847200.0 + 12 * i) for i, p in enumerate(PASSES)]
    info = loguru_line({}, 1689847201.0, level="INFO", message="starting forward pass")
    zname = "completions.2023-07-20_10-00-00_000001.log"
    with zipfile.ZipFile(folder / (zname + ".zip"), "w") as z:
        z.writestr(zname, "\n".join([info, lines[0], lines[1]]) + "\n")
    (folder / "completions.2023-07-20_10-00-30_000002.log.gz").write_bytes(gzip.compress(("\n".join(lines[2:4]) + "\n").encode()))
    (folder / "completions.log").write_text("\n".join(lines[4:]) + "\n")
    (folder / "notes.txt").write_text("not a log\n")
    return folder


def parquet_v11(path: Path, *, exported: bool = False) -> Path:
    """The same run as a published parquet file, layout v1.1 (one row per step); `exported`: every
    number a double, as the published export stores them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**event(p, 1000 + i), "_step": i, "_timestamp": 1689847200.0 + i} for i, p in enumerate(PASSES)]
    if exported:
        rows = [as_exported(r) for r in rows]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def as_exported(value: Any) -> Any:
    """`value` with every integer stored as the published exports store numbers: a double (1000000.0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, list):
        return [as_exported(v) for v in value]
    if isinstance(value, dict):
        return {k: as_exported(v) for k, v in value.items()}
    return value


def parquet_v10(path: Path, *, exported: bool = False) -> Path:
    """A layout v1.0 file: one row per forward pass (followup, then answer); combined rewards only.
    `exported`: numbers as the published export stores them (doubles; the second row's missing
    `gating_loss` a NaN), which `EQUIVALENT_V10` gives as the steps `score` reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"base_prompt": "Describe the water cycle.", "followup_prompt": "Ask about: Describe the water cycle.",
         "followup_completions": ["What drives evaporation?", "", "Why does it rain?"],
         "followup_rewards": [0.4, 0.0, 0.3], "followup_times": [1.0, 12.0, 2.0], "followup_uids": [1, 2, 3],
         "best_followup": "What drives evaporation?",
         "answer_prompt": "Answer: What drives evaporation?",
         "answer_completions": ["The sun's heat.", "What drives evaporation?", "Wind, too."],
         "answer_rewards": [0.6, 0.0, 0.2], "answer_times": [1.0, 1.0, 1.0], "answer_uids": [1, 2, 3],
         "best_answer": "The sun's heat.", "block": 77, "gating_loss": 0.2, "step_length": 3.0, "_step": 0},
        {"base_prompt": "Explain tides.", "followup_prompt": None,
         "followup_completions": ["Why two tides a day?", "Is the moon involved?"],
         "followup_rewards": [0.5, 0.4], "followup_times": [1.0, 1.0], "followup_uids": [4, 5],
         "best_followup": "Why two tides a day?",
         "answer_prompt": "Answer: Why two tides a day?",
         "answer_completions": ["Two bulges of water.", "   "],
         "answer_rewards": [0.7, 0.0], "answer_times": [1.0, 1.0], "answer_uids": [4, 5],
         "best_answer": "Two bulges of water.", "block": 78, "gating_loss": 0.1, "step_length": 2.0, "_step": 1},
    ]
    if exported:
        rows = [as_exported(r) for r in rows]
        rows[1]["gating_loss"] = NAN
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# The steps of `parquet_v10(exported=True)` as `rewardstack score` reads them, written out by hand
# from the spec (followup then answer per row; an empty or blank completion is a failed call).
EQUIVALENT_V10 = [
    {"name": "followup", "prompt": "Ask about: Describe the water cycle.", "base_prompt": "Describe the water cycle.",
     "completions": ["What drives evaporation?", None, "Why does it rain?"], "logged_best": "What drives evaporation?",
     "new_forward_pass": True, "uids": [1, 2, 3], "completion_times": [1.0, 12.0, 2.0], "block": 77, "gating_loss": 0.2},
    {"name": "answer", "prompt": "Answer: What drives evaporation?", "base_prompt": "What drives evaporation?",
     "completions": ["The sun's heat.", "What drives evaporation?", "Wind, too."], "logged_best": "The sun's heat.",
     "uids": [1, 2, 3], "completion_times": [1.0, 1.0, 1.0], "block": 77, "gating_loss": 0.2},
    {"name": "followup", "prompt": "Explain tides.", "base_prompt": "Explain tides.",
     "completions": ["Why two tides a day?", "Is the moon involved?"], "logged_best": "Why two tides a day?",
     "new_forward_pass": True, "uids": [4, 5], "completion_times": [1.0, 1.0], "block": 78},
    {"name": "answer", "prompt": "Answer: Why two tides a day?", "base_prompt": "Why two tides a day?",
     "completions": ["Two bulges of water.", None], "logged_best": "Two bulges of water.",
     "uids": [4, 5], "completion_times": [1.0, 1.0], "block": 78},
]
