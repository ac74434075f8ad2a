"""The soak's verdict: what failed, the figures behind it, and its text for a person.

`judge` turns the comparison (`tests.soak.comparison`), the supervisors' counts and the
memory fit into a verdict dict (`passed`, `failures` and the figures; written to `summary.json`
under `soak`); `format_verdict` prints it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.soak.comparison import DIVERSITY_REBATCH_TOL, REBATCH_TOL, TOL

RSS_MIN_SPAN = 100
"""Steps a process's fitted segment must span, on average, for the RSS slope to be judged: over
shorter segments a process's arena growth in its first hundred steps (a few MiB, then flat) reads
as a slope of 100+ KiB a step (a 200-step soak with 3 kills: 148 KiB over 40-step segments)."""
MIN_MEMORY_POINTS = 10
"""Points after warm-up a soak of 100 steps or more must have for its memory fit to count."""

CLEAN_RSS_MIN_SPAN = 1000
"""Steps the clean run's fit must span for its resident-set slope to be judged (reported below it)."""


def judge(*, cmp: dict[str, Any], sup: dict[str, Any], clean_sup: dict[str, Any], clean_events: int,
          memory: dict[str, Any], ooms: dict[str, int], statuses: Counter[str], kills_wanted: int, faults: float,
          max_slope: float, max_rss_slope: float, clean_memory: dict[str, Any] | None = None,
          **figures: Any) -> dict[str, Any]:
    """The verdict dict: every check that fails adds a line to `failures`.

    `clean_memory`: the clean run's fit (`memory_slope` of its one uninterrupted process), judged
    by the same limits. With many kills no faulted process lives `RSS_MIN_SPAN` steps, so the
    faulted run's resident set cannot be judged; the clean run's single process can, once it spans
    `CLEAN_RSS_MIN_SPAN` steps (a fresh process's arenas grow for its first hundreds of steps:
    126 KiB a step over a 200-step clean run, 10 KiB over the 1,690 settled steps of a 2,000-step one)."""
    failures = []
    if cmp["missing"] or cmp["duplicates"] or not cmp["in_order"] or cmp["events"] != cmp["expected"]:
        failures.append(f"events: {cmp['events']} of {cmp['expected']}, {cmp['missing']} missing, "
                        f"{cmp['duplicates']} duplicated, in order {cmp['in_order']}")
    if clean_events != cmp["expected"]:
        failures.append(f"the clean run wrote {clean_events} of {cmp['expected']} events")
    if cmp["mismatched_values"]:
        failures.append(f"{cmp['mismatched_values']} values differ from the clean run")
    if cmp["unexplained_exclusions"] or cmp["oom_in_statistics"]:
        failures.append(f"{cmp['unexplained_exclusions']} completions left out of the statistics without 'oom', "
                        f"{cmp['oom_in_statistics']} 'oom' completions counted")
    if cmp["oom_gave_up"] != cmp["oom_statuses"]:
        failures.append(f"{cmp['oom_gave_up']} OOMs given up on but {cmp['oom_statuses']} 'oom' model statuses")
    if not cmp["normalizers_equal"]:
        failures.append(f"normalizer statistics differ from the clean run's (largest difference {cmp['max_normalizer_diff']:.3g})")
    if cmp["steps_in_state"] != cmp["expected"]:
        failures.append(f"the state counts {cmp['steps_in_state']} steps for {cmp['expected']}")
    if sup["crashes"] or clean_sup["crashes"]:
        failures.append(f"{sup['crashes'] + clean_sup['crashes']} scoring process(es) crashed (see worker-*.log)")
    if sup["kills"] < kills_wanted:
        failures.append(f"only {sup['kills']} of {kills_wanted} kills landed (the run ended first)")
    if faults > 0 and ooms["injected"] == 0:
        failures.append("faults were asked for and none was injected")
    if memory["points"] < MIN_MEMORY_POINTS and cmp["expected"] >= 10 * MIN_MEMORY_POINTS:
        failures.append(f"memory at rest was not judged: {memory['points']} points after warm-up")
    if memory["slope_bytes_per_step"] > max_slope:
        failures.append(f"tracked memory at rest grows {memory['slope_bytes_per_step']:.1f} bytes/step (limit {max_slope:g})")
    # Over the clean run's curve where there is one (`memory_slope(reference=...)`): a killed run's
    # processes are young, and a young process's arenas grow steeply and then flatten, so their raw
    # slope pooled reads as a leak with nothing kept (the 10,000-step soak with 20 kills: 29.1 KiB a
    # step raw over 21 processes; -0.8 KiB a step over the clean run's curve).
    rss, judged_as = memory.get("rss_excess_slope_bytes_per_step"), " over the clean run's at the same process age"
    if rss is None:
        rss, judged_as = memory.get("rss_slope_bytes_per_step"), ""
    if rss is not None and memory.get("span_steps", 0) >= RSS_MIN_SPAN and rss > max_rss_slope:
        failures.append(f"resident set grows {rss:.0f} bytes/step{judged_as} (limit {max_rss_slope:g})")
    if clean_memory is not None:
        if clean_memory["slope_bytes_per_step"] > max_slope:
            failures.append(f"the clean run's tracked memory at rest grows {clean_memory['slope_bytes_per_step']:.1f} "
                            f"bytes/step (limit {max_slope:g})")
        c_rss = clean_memory.get("rss_slope_bytes_per_step")
        if c_rss is not None and clean_memory.get("span_steps", 0) >= CLEAN_RSS_MIN_SPAN and c_rss > max_rss_slope:
            failures.append(f"the clean run's resident set grows {c_rss:.0f} bytes/step (limit {max_rss_slope:g})")
        figures["clean_memory"] = clean_memory
    return {
        "passed": not failures, "failures": failures, "completions": dict(statuses), "ooms": ooms,
        "kills": sup["kills"], "restarts": sup["restarts"], "crashes": sup["crashes"] + clean_sup["crashes"],
        "kill_points": sup["kill_points"], "memory": {**memory, "max_slope": max_slope, "max_rss_slope": max_rss_slope},
        "comparison": cmp, "faults": faults, **figures,
    }


def _clean_memory_line(cm: dict[str, Any], m: dict[str, Any]) -> str:
    """The clean run's memory at rest: one process, the whole run after warm-up."""
    rss = cm.get("rss_slope_bytes_per_step")
    judged = cm.get("span_steps", 0) >= CLEAN_RSS_MIN_SPAN
    return (f"  clean run's memory at rest ({cm['points']} points over {cm.get('span_steps', 0):.0f} steps of one process): "
            f"tracked slope {cm['slope_bytes_per_step']:.2f} bytes/step; "
            + (f"RSS slope {rss:.0f} bytes/step (limit {m['max_rss_slope']:g}{'' if judged else '; not judged'}), range "
               f"{cm['rss_bytes_min'] / 2**20:.0f}..{cm['rss_bytes_max'] / 2**20:.0f} MiB" if rss is not None else "RSS not measured"))


def pace(steps_per_second: float) -> str:
    """A run's pace in words: steps a second, or seconds a step when slower than one a second
    (a 25 s step read "0.0 steps/s")."""
    if steps_per_second <= 0:
        return "no step timed"
    return f"{steps_per_second:.1f} steps a second" if steps_per_second >= 1 else f"{1 / steps_per_second:.1f} s a step"


def _mib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"


def format_verdict(v: dict[str, Any]) -> str:
    """The verdict for a person."""
    c, o, m = v["comparison"], v["ooms"], v["memory"]
    rss, excess = m.get("rss_slope_bytes_per_step"), m.get("rss_excess_slope_bytes_per_step")
    rows = [
        f"soak verdict: {'PASS' if v['passed'] else 'FAIL'}",
        f"  steps {v['steps']} x {v['completions_per_step']} completions; input errors {v['input_errors']} (lines refused)",
        "  completions by status: " + ", ".join(f"{k} {n}" for k, n in sorted(v["completions"].items())),
        f"  OOMs injected {o['injected']} (real {o['real']}) / recovered {o['recovered']} (split {o['split']}, host fallback "
        f"{o['cpu_fallback']}) / gave up {o['gave_up']} -> model statuses 'oom' {c['oom_statuses']}, completions "
        f"reported 'oom' {o['reported']}",
        f"  kills {v['kills']}, restarts {v['restarts']}, crashes {v['crashes']}",
        f"  memory at rest ({m['basis']}; {m['points']} points, {m.get('processes', '?')} processes): tracked slope "
        f"{m['slope_bytes_per_step']:.2f} bytes/step (limit {m['max_slope']:g}), between {_mib(m['rest_bytes_min'])} and "
        f"{_mib(m['rest_bytes_max'])}; "
        + (f"RSS slope {rss:.0f} bytes/step, range {m['rss_bytes_min'] / 2**20:.0f}..{m['rss_bytes_max'] / 2**20:.0f} MiB"
           + (f"; over the clean run's at the same process age {excess:.0f} bytes/step, {m['rss_excess_min'] / 2**20:.1f}.."
              f"{m['rss_excess_max'] / 2**20:.1f} MiB" if excess is not None else "")
           + f" (limit {m['max_rss_slope']:g} on the {'slope over the clean run' if excess is not None else 'raw slope'}"
           + ("" if m.get("span_steps", 0) >= RSS_MIN_SPAN else f"; not judged: segments span {m.get('span_steps', 0):.1f} "
              f"steps, under {RSS_MIN_SPAN}") + ")" if rss is not None else "RSS not measured"),
        *([_clean_memory_line(v["clean_memory"], m)] if v.get("clean_memory") else []),
        f"  comparison with the clean run: events {c['events']}/{c['expected']}, missing {c['missing']}, duplicated "
        f"{c['duplicates']}, in order {c['in_order']}; values differing {c['mismatched_values']} (beyond {TOL:g}); "
        f"float32 batching noise after a split {c['rebatched_values']} {c['rebatched_by_model']} (largest "
        f"{c['rebatched_max_diff']:.2g}, bound {REBATCH_TOL:g}, diversity {DIVERSITY_REBATCH_TOL:g}); unexplained exclusions {c['unexplained_exclusions']}; "
        f"normalizers equal {c['normalizers_equal']} (max diff {c['max_normalizer_diff']:.3g})",
        f"  {v['seconds']:,.0f} s in all, start-ups and restarts included: the faulted and the clean run side by side, "
        f"each {v['steps']} steps at {pace(v.get('steps_per_second', 0))}",
    ]
    for r in c.get("rebatched", [])[:5]:
        rows.append(f"    batching noise: step {r['step']}, completion {r['index']}, {r['model']}: {r['diff']:.2g}")
    for mm in c["mismatches"][:5]:
        rows.append(f"    differs: step {mm['step']}, completion {mm['index']}, {mm['model']}: faulted {mm['faulted']!r}, "
                    f"clean {mm['clean']!r}")
    rows += [f"  FAILED: {f}" for f in v["failures"]]
    return "\n".join(rows)
