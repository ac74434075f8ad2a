"""The soak's judgement of a faulted run against a clean one, and of memory at rest.

`compare` is strict: every expected step's event present exactly once and in order; every value of
every completion not reported `oom` within `TOL` of the clean run's (relative, floor 1), except
float32 batching noise after an OOM split (within `rebatch_tol`, counted apart and listed); a
completion a model reported `oom` is out of the statistics and nothing else is; every OOM the guard
gave up on is one `oom` model status; the final normalizer statistics equal the clean run's raw
values folded over the same included completions.

`memory_slope` fits the growth of memory at rest (tracked bytes, and the process's resident set),
per process, after a warm-up; the soak fails above a slope limit (docs/REPLAY.md says why).

Events are read one line at a time (`iter_events`, `EventIndex`): a 10,000-step run's event file
is about a gigabyte and is never held in memory whole.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from rewardstack.config import MASKS, REWARD_MODELS
from rewardstack._models import DIVERSITY, MODELS, owner_of

TOL = 1e-6
REBATCH_TOL = 1e-5
"""A model's pass split after a recovered OOM runs its inputs in other batch shapes (other padding,
another float32 summation order): its values there may move by float32 batching noise, up to this
(relative, floor 1), and are counted apart; anything further is a failure."""
DIVERSITY_REBATCH_TOL = 1e-4
"""Diversity's bound on the same noise. Its history part maps a distance x through
1 / (1 + exp(-1000x + 50)) (docs/SEMANTICS.md), whose slope reaches 1000/4 = 250, and its batch part
through a slope of up to 40/4 = 10: a float32 cosine that moves by a few ulps under another
batching (4e-7, about 3 ulps near 1) moves the score by up to 1e-4. Seen: the 300-step soak on
the standard stand-ins (the real MiniLM) moved 376 diversity values, 67 past 1e-6, the largest by
1.0e-5 (over REBATCH_TOL), with every other model's largest under 2e-6."""
# Diversity embeds with relevance's second model (one checkpoint, one embedding cache per step): a
# split of that pass moves diversity's values by the same float32 batching noise.
SHARED_PASS = {m.embeds_with: m.name for m in MODELS if m.embeds_with}


LISTED = 20
"""Differences (and batching-noise values) listed by step, completion and model in the verdict."""
_HEAVY = ("completions", "prompt", "base_prompt", "best", "uids", "rewards")  # not compared: dropped on read


def _light(line: bytes) -> dict[str, Any]:
    return {k: v for k, v in json.loads(line).items() if k not in _HEAVY and not k.endswith("_normalized")}


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of an event JSONL, one at a time, without their texts (split on `\\n` only)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                yield _light(raw)


class EventIndex:
    """An event file by `step_hash`: offsets in memory, each event read when asked for (`get`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets: dict[str, int] = {}
        self.count = 0
        if path.exists():
            with path.open("rb") as f:
                pos = 0
                for raw in f:
                    if raw.strip():
                        self.count += 1
                        start = raw.find(b'"step_hash": "')
                        h = raw[start + 14:start + 30].decode() if start >= 0 else json.loads(raw).get("step_hash")
                        self.offsets.setdefault(h, pos)
                    pos += len(raw)

    def get(self, h: str) -> dict[str, Any] | None:
        if h not in self.offsets:
            return None
        with self.path.open("rb") as f:
            f.seek(self.offsets[h])
            return _light(f.readline())


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def same(a: Any, b: Any, tol: float = TOL) -> bool:
    """Equal within `tol` (relative, floor 1); NaN equals only NaN."""
    x, y = _num(a), _num(b)
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= tol * max(1.0, abs(y))


class _Differences:
    """The values where the runs differ: within the rebatching tolerance of a model whose pass
    the faulted step split (counted per model, with the largest difference), or mismatched; the
    first `LISTED` of each listed."""

    def __init__(self) -> None:
        self.mismatches: list[dict[str, Any]] = []
        self.rebatched: list[dict[str, Any]] = []
        self.rebatched_by_model: Counter[str] = Counter()
        self.mismatched_values = 0
        self.rebatched_max = 0.0

    def add(self, pos: int, i: int, m: str, x: Any, y: Any, split: set[str]) -> None:
        if m in split and same(x, y, DIVERSITY_REBATCH_TOL if m == DIVERSITY.name else REBATCH_TOL):
            self.rebatched_by_model[m] += 1
            self.rebatched_max = max(self.rebatched_max, abs(_num(x) - _num(y)))
            if len(self.rebatched) < LISTED:
                self.rebatched.append({"step": pos, "index": i, "model": m, "diff": abs(_num(x) - _num(y))})
        else:
            self.mismatched_values += 1
            if len(self.mismatches) < LISTED:
                self.mismatches.append({"step": pos, "index": i, "model": m, "faulted": x, "clean": y})


def compare(expected_hashes: Sequence[str], faulted: Iterable[dict[str, Any]],
            clean: EventIndex | Sequence[dict[str, Any]],
            faulted_state: dict[str, Any], active_rewards: list[str]) -> dict[str, Any]:
    """The soak's comparison of the faulted run against the clean one (see the module docstring).

    `clean`: the clean run's events by `step_hash` (an `EventIndex`), or as a list. Also returned:
    the faulted run's completions by status (`completions`) and its OOMs from the committed
    `soak_ooms` records (`ooms`), which the verdict reports apart from the comparison.
    """
    from rewardstack._state import RunningNormalizer

    by_hash = clean if isinstance(clean, EventIndex) else {e.get("step_hash"): e for e in clean}
    counts: Counter[str] = Counter()
    order_ok = True
    # Per active model, the clean run's raw values over the completions the faulted run included.
    folded = {m: RunningNormalizer() for m in active_rewards}
    diffs = _Differences()
    unexplained = oom_included = oom_statuses = 0
    statuses: Counter[str] = Counter()
    ooms = dict.fromkeys(("injected", "recovered", "gave_up", "real", "split", "cpu_fallback"), 0)
    history_noise = False
    pos = -1
    for pos, f in enumerate(faulted):
        h = f.get("step_hash")
        counts[h] += 1
        if pos >= len(expected_hashes) or expected_hashes[pos] != h:
            order_ok = False
        recs = f.get("soak_ooms", [])
        statuses.update(f["statuses"])
        for r in recs:  # the step's committed OOM records: injected or real, and what the guard did
            ooms["injected" if r["injected"] else "real"] += 1
            ooms[r["action"]] += 1  # `OomRecord.action`: "split", "cpu_fallback" or "gave_up"
            ooms["recovered"] += r["action"] != "gave_up"
        oom_statuses += sum(s == "oom" for sts in f.get("model_statuses", {}).values() for s in sts)
        c = by_hash.get(h)
        if c is None:
            continue
        raw = [r["model"] for r in recs if r["action"] == "split"]
        split = {owner_of(m) for m in raw} | {SHARED_PASS[m] for m in raw if m in SHARED_PASS}
        # Diversity compares each completion with the embeddings of earlier steps: noise from one
        # split stays in its history, so its values may carry it in every later step too.
        history_noise = history_noise or DIVERSITY.name in split
        if history_noise:
            split.add(DIVERSITY.name)
        for i, status in enumerate(f["statuses"]):
            if status == "oom":
                # Reported lost: its raw values must be out of the statistics (NaN), nothing else.
                oom_included += any(not math.isnan(_num(f[m][i])) for m in active_rewards
                                    if f["model_statuses"].get(m, [None] * (i + 1))[i] == "oom")
                continue
            pairs = [(m, f[m][i], c[m][i]) for m in [*REWARD_MODELS, *MASKS]] + [("status", status, c["statuses"][i])]
            for m, x, y in pairs:
                if not ((x == y) if m == "status" else same(x, y)):
                    diffs.add(pos, i, m, x, y, split)
        # The clean run's raw values of the completions the faulted step included, folded; and the
        # faulted values that are NaN where the clean run's are not with no OOM to explain it.
        n = len(f["statuses"])
        for m in active_rewards:
            folded[m].update([_num(c[m][i]) for i in range(n) if not math.isnan(_num(f[m][i]))])
            unexplained += sum(1 for i in range(n) if math.isnan(_num(f[m][i])) and not math.isnan(_num(c[m][i]))
                               and f["statuses"][i] != "oom" and f["model_statuses"].get(m, [""] * (i + 1))[i] != "oom")
    norm_equal, norm_diff = _normalizers_match(folded, faulted_state.get("normalizers", {}), active_rewards)
    return {
        "events": pos + 1, "expected": len(expected_hashes),
        "missing": sum(1 for h in expected_hashes if h not in counts),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "in_order": order_ok and pos + 1 == len(expected_hashes), "mismatched_values": diffs.mismatched_values,
        "mismatches": diffs.mismatches, "rebatched_values": sum(diffs.rebatched_by_model.values()),
        "rebatched_by_model": dict(diffs.rebatched_by_model), "rebatched_max_diff": diffs.rebatched_max,
        "rebatched": diffs.rebatched,
        "unexplained_exclusions": unexplained, "oom_in_statistics": oom_included,
        "oom_gave_up": ooms["gave_up"], "oom_statuses": oom_statuses,
        "normalizers_equal": norm_equal, "max_normalizer_diff": norm_diff,
        "steps_in_state": faulted_state.get("stack", {}).get("steps_scored"),
        "ooms": {**ooms, "reported": statuses.get("oom", 0)}, "completions": statuses,
    }


def _normalizers_match(folded: dict[str, Any], stored: dict[str, Any], active: list[str]) -> tuple[bool, float]:
    """(whether the faulted run's final normalizer statistics equal `folded` within `TOL`, the largest difference)."""
    norm_diff = 0.0
    norm_equal = True
    for m in active:
        want, have = folded[m], stored.get(m, {})
        norm_equal &= have.get("count") == want.count
        for key in ("mean", "var"):
            d = abs(float(have.get(key, math.nan)) - getattr(want, key))
            norm_diff = max(norm_diff, d) if not math.isnan(d) else math.inf
            norm_equal &= d <= TOL * max(1.0, abs(getattr(want, key)))
    return norm_equal, norm_diff


# -- memory at rest -------------------------------------------------------------------------------

PROCESS_WARMUP = 20
"""Steps of each scoring process left out of the memory fit: a new process fills its caches
(allocator arenas, tokenizer caches, lazily imported code) in its first steps."""


def _slope(points: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares slope of `key` against steps, pooled within each process (None: no data)."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for r in points:
        if r.get(key) is not None:
            by_pid.setdefault(r["pid"], []).append((float(r["steps"]), float(r[key])))
    if not by_pid:
        return None
    sxy = sxx = 0.0
    for xs in by_pid.values():
        mx = sum(x for x, _ in xs) / len(xs)
        my = sum(y for _, y in xs) / len(xs)
        sxy += sum((x - mx) * (y - my) for x, y in xs)
        sxx += sum((x - mx) ** 2 for x, _ in xs)
    return sxy / sxx if sxx > 0 else 0.0


def _read_rest(path: Path) -> list[dict[str, Any]]:
    """The rest log's records (one per committed step), [] when there is none."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def memory_slope(rest_path: Path, n_steps: int, *, reference: Path | None = None) -> dict[str, Any]:
    """Least-squares slopes of memory at rest (tracked bytes, RSS; bytes per step), pooled within
    each process, after the diversity history is full (else after a warm-up of N/5 steps) and
    after each process's first `PROCESS_WARMUP` steps (at most N/10).

    `reference`: the clean run's rest log. A process's resident set rises steeply and then flattens
    as its arenas warm up (the 10,000-step clean run: 153 KiB a step over its steps 20-200, 5 KiB
    over 1,000-3,000, 0.4 KiB over 6,000-10,000), so short processes of a killed run show a steep
    slope with nothing kept. With a reference, each point's resident set minus the clean process's
    at the same age (steps since its start) is fitted too (`rss_excess_slope_bytes_per_step`):
    warm-up common to both cancels, and what the faulted path keeps (per OOM, per restart) grows."""
    from rewardstack._scorers.embedding import HISTORY_MAX

    process_warmup = min(PROCESS_WARMUP, n_steps // 10)
    recs = _read_rest(rest_path)
    first: dict[int, int] = {}
    for r in recs:
        first.setdefault(r["pid"], r["steps"])
    settled = [r for r in recs if r["steps"] - first[r["pid"]] >= process_warmup]
    full = [r for r in settled if r["history_rows"] >= HISTORY_MAX]
    # Said as a person reads it: which steps count, and which were left out as warm-up.
    each = f", each process's first {process_warmup} steps left out" if process_warmup else ""
    if len(full) >= 20:
        pts, basis = full, f"once the diversity history was full{each}"
    else:
        warm = max(3, n_steps // 5)
        pts = [r for r in settled if r["steps"] > warm]
        basis = f"from step {warm + 1} on (the first {warm} steps are warm-up; the diversity history never filled){each}"
    spans: dict[int, list[int]] = {}
    for r in pts:
        spans.setdefault(r["pid"], []).append(r["steps"])
    span = sum(max(v) - min(v) for v in spans.values()) / len(spans) if spans else 0.0
    slope = _slope(pts, "rest_bytes") or 0.0
    rest = [r["rest_bytes"] for r in pts]
    rss = [r["rss_bytes"] for r in pts if r.get("rss_bytes") is not None]
    out = {"slope_bytes_per_step": slope, "points": len(pts), "processes": len(spans), "span_steps": span, "basis": basis,
           "rest_bytes_min": min(rest) if rest else None, "rest_bytes_max": max(rest) if rest else None,
           "rss_slope_bytes_per_step": _slope(pts, "rss_bytes"),
           "rss_bytes_min": min(rss) if rss else None, "rss_bytes_max": max(rss) if rss else None}
    if reference is not None:
        out.update(_rss_excess(pts, first, _read_rest(reference)))
    return out


def _rss_excess(pts: list[dict[str, Any]], first: dict[int, int], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """The fit of each point's resident set minus the reference process's at the same age."""
    if not ref or len({r["pid"] for r in ref}) != 1:  # the reference is one uninterrupted process
        return {"rss_excess_slope_bytes_per_step": None, "rss_excess_points": 0}
    r0 = ref[0]["steps"]
    at_age = {r["steps"] - r0: r["rss_bytes"] for r in ref if r.get("rss_bytes") is not None}
    excess = []
    for r in pts:
        age = r["steps"] - first[r["pid"]]
        if r.get("rss_bytes") is not None and age in at_age:
            excess.append({"pid": r["pid"], "steps": age, "rss_excess": r["rss_bytes"] - at_age[age]})
    vals = [e["rss_excess"] for e in excess]
    return {"rss_excess_slope_bytes_per_step": _slope(excess, "rss_excess"), "rss_excess_points": len(excess),
            "rss_excess_min": min(vals) if vals else None, "rss_excess_max": max(vals) if vals else None}
