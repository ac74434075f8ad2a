"""Seeded fuzzing of the step reader, `score` and `POST /v1/score` with hostile documents.

A seeded generator (no extra dependency) makes valid steps (random Unicode, optional fields) and
known-bad variants of them: bytes that are not UTF-8, deep nesting (65 to 5,000 levels), broken
syntax, documents that are not objects, a wrong type in each field, a missing field, a lone
surrogate, `NaN` constants, too many completions, huge strings. Every case knows what it must
give: the reader yields a Step for each good line and an InputError naming the line for each bad
one, and never raises; `score` writes one event per good line; the service answers every good
body 200 with its event and every bad one with the 4xx its kind calls for, never a 500.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest

from rewardstack import _runner as runner
from rewardstack.errors import InputError
from rewardstack._settings import InputSettings
from rewardstack.stack import RewardStack, Step

from test_hostile_input import service  # noqa: F401 - the in-process service fixture

CHARS = ["a", "Z", "0", " ", " ", "\n", "\t", "\u00e9", "\u6771", "\U0001f642", "\u0301", '"', "\\", "\u2028", "\x00",
         "<|endoftext|>", "[SEP]", "\ufeff"]
TASKS = ["augment", "followup0", "answer0", "followup3", "answer2"]
MAX_COMPLETIONS = 8
SERVICE_MAX_CHARS = 4000  # the service fixture's limit


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(0, n)))


def good_step(rng: random.Random) -> dict[str, Any]:
    n = rng.randint(0, 6)
    comps = [None if rng.random() < 0.15 else _text(rng, 40) for _ in range(n)]
    d: dict[str, Any] = {"name": rng.choice(TASKS), "prompt": _text(rng, 60), "completions": comps}
    if rng.random() < 0.5:
        d["uids"] = [rng.randint(0, 4096) for _ in range(n)]
    if rng.random() < 0.3:
        d["completion_times"] = [rng.random() * 10 for _ in range(n)]
    if rng.random() < 0.3:
        d["base_prompt"] = _text(rng, 30)
    if rng.random() < 0.3:
        d["block"] = rng.randint(0, 10**7)
    if rng.random() < 0.3:
        d["gating_loss"] = rng.random()
    if rng.random() < 0.2:
        d["set_weights"] = [rng.random() for _ in range(3)]
    if rng.random() < 0.2:
        d["failed"] = [rng.random() < 0.5 for _ in range(n)]
    return d


def _dump(d: Any, rng: random.Random) -> bytes:
    return json.dumps(d, ensure_ascii=rng.random() < 0.5).encode("utf-8")


WRONG: dict[str, list[Any]] = {
    "name": [123, None, "bogus", "augment0x", ["augment"]],
    "prompt": [5, [], None, {"t": "x"}],
    "completions": ["x", [1], {}, [["a"]], None],
    "base_prompt": [3, ["b"]],
    "uids": [["a"], [1.5], "0,1", [True]],
    "completion_times": [["x"], "1.0", [None]],
    "block": [-1, 1.5, "3", True, [1]],
    "gating_loss": ["x", [], True],
    "set_weights": [{"a": 1}, "s", [[["deep"]]]],
    "new_forward_pass": ["yes", 1],
}

# Each mutation: (bytes, reader gives a Step?, the service's status)
Case = tuple[bytes, bool, int]


def _good(rng: random.Random, d: dict) -> Case:
    return _dump(d, rng), True, 200


def _bad_bytes(rng: random.Random, d: dict) -> Case:
    d["prompt"] = "@@"
    raw = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xe6\x9d", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])
    return _dump(d, rng).replace(b"@@", raw), False, 400


def _deep(rng: random.Random, d: dict) -> Case:
    depth = rng.choice([65, 200, 999, 1500, 5000])
    d["set_weights"] = "@@"
    return _dump(d, rng).replace(b'"@@"', b"[" * depth + b"]" * depth), False, 400


def _deep_doc(rng: random.Random, d: dict) -> Case:
    depth = rng.choice([65, 999, 3000])
    return (b'{"a": ' * depth + b"1" + b"}" * depth) if rng.random() < 0.5 else b"[" * depth + b"]" * depth, False, 400


def _syntax(rng: random.Random, d: dict) -> Case:
    data = _dump(d, rng)
    return data[: rng.randint(1, len(data) - 1)].replace(b"\n", b" "), False, 400


def _not_object(rng: random.Random, d: dict) -> Case:
    return json.dumps(rng.choice([[d], 3, "step", None, True])).encode(), False, 422


def _wrong_type(rng: random.Random, d: dict) -> Case:
    key = rng.choice(sorted(WRONG))
    d[key] = rng.choice(WRONG[key])
    if key == "uids" and rng.random() < 0.3:
        d["uids"] = list(range(len(d["completions"]) + 1))  # wrong length
    return _dump(d, rng), False, 422


def _missing(rng: random.Random, d: dict) -> Case:
    del d[rng.choice(["name", "prompt", "completions"])]
    return _dump(d, rng), False, 422


def _surrogate(rng: random.Random, d: dict) -> Case:
    d["prompt"] = "x\ud800y"
    return json.dumps(d).encode(), False, 422


def _nan(rng: random.Random, d: dict) -> Case:
    d["gating_loss"] = float(rng.choice(["nan", "inf", "-inf"]))
    return json.dumps(d).encode(), True, 400  # the step file keeps the validator's NaN; HTTP bodies are strict JSON


def _too_many(rng: random.Random, d: dict) -> Case:
    d["completions"] = [_text(rng, 10) for _ in range(MAX_COMPLETIONS + rng.randint(1, 30))]
    d.pop("uids", None), d.pop("completion_times", None), d.pop("failed", None)
    return _dump(d, rng), False, 413


def _huge(rng: random.Random, d: dict) -> Case:
    d["completions"] = ["word " * rng.randint(SERVICE_MAX_CHARS // 5 + 1, 20_000)] + [_text(rng, 10)]
    d.pop("uids", None), d.pop("completion_times", None), d.pop("failed", None)
    return _dump(d, rng), True, 413


MUTATIONS: list[tuple[Callable[[random.Random, dict], Case], int]] = [
    (_good, 8), (_bad_bytes, 2), (_deep, 2), (_deep_doc, 1), (_syntax, 2), (_not_object, 1), (_wrong_type, 4),
    (_missing, 1), (_surrogate, 1), (_nan, 1), (_too_many, 1), (_huge, 1),
]


def cases(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    fns = [f for f, w in MUTATIONS for _ in range(w)]
    return [rng.choice(fns)(rng, good_step(rng)) for _ in range(n)]


def test_the_step_reader_names_every_bad_line_and_reads_every_good_one() -> None:
    batch = cases(22, 400)
    data = b"\n".join(line for line, _, _ in batch) + b"\n"
    out = list(runner.iter_steps(io.BytesIO(data), InputSettings(max_completions=MAX_COMPLETIONS)))
    assert [number for number, _ in out] == list(range(1, len(batch) + 1))
    for (number, got), (line, good, _) in zip(out, batch):
        if good:
            assert isinstance(got, Step), (number, got, line[:200])
        else:
            assert isinstance(got, InputError) and f"line {number}" in str(got), (number, line[:200])
    assert sum(good for _, good, _ in batch) > 100 and sum(not good for _, good, _ in batch) > 100


def test_score_writes_one_event_per_good_line(tmp_path: Path, fake_config) -> None:  # noqa: ANN001
    fake_config.input.max_completions = MAX_COMPLETIONS
    fake_config.input.max_chars = 20_000
    batch = cases(7, 200)
    steps = tmp_path / "steps.jsonl"
    steps.write_bytes(b"\n".join(line for line, _, _ in batch) + b"\n")
    stack = RewardStack(fake_config, load_state=False)
    err = io.StringIO()
    report = runner.score_file(stack, steps, tmp_path / "ev.jsonl", save_every=50, err=err, progress=False)
    good = [json.loads(line) for line, ok, _ in batch if ok]
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text(encoding="utf-8").split("\n")[:-1]]  # not splitlines: U+2028
    assert report.scored == len(good) == len(events)
    assert len(report.errors) == len(batch) - len(good)
    assert [e["prompt"] for e in events] == [g["prompt"] for g in good]
    for e, g in zip(events, good):
        long = [len(c or "") > 20_000 for c in g["completions"]]
        assert [s == "cut" for s in e["statuses"]] == long  # past max_chars: read in part, and said so


def test_post_score_answers_every_body_with_its_4xx_or_its_event(service) -> None:  # noqa: ANN001, F811
    batch = cases(18, 240)
    got = []
    for k in range(0, len(batch), 16):  # 16 at a time: the queue never fills
        got += service(*[line for line, _, _ in batch[k : k + 16]])
    for r, (line, _, want) in zip(got, batch):
        assert r.status_code == want, (r.status_code, r.text[:300], line[:200])
        if want == 200:
            body = r.json()
            assert len(body["rewards"]) == len(json.loads(line)["completions"]) and body["sequence"] >= 1
        else:
            err = r.json()["error"]
            assert err["type"] and err["message"]
    assert sum(r.status_code == 200 for r in got) > 60
