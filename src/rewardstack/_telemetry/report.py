"""`rewardstack report RUN_DIR`: plots and a one-page summary of a run directory.

Reads the timeline (every segment still on disk), the events, the incidents and summary.json, and
writes to `RUN_DIR/report/` (or `--out`): five PNG plots drawn with matplotlib's headless Agg
backend, and `report.html`, one self-contained page with the plots embedded (no network, no
scripts). The same short summary is printed on the terminal: the inputs behind the highest peaks,
the OOMs, the leak verdict and the cost model's error.

The card's picture (`plot_card`) draws the account the monitor records in each step record
(`card`): a stacked area over steps (one band per model's weights on the card, then activations,
then fragmentation), step boundaries as vertical lines, the card's size and the weights +
activation budget as horizontal lines, swaps and OOMs marked per step, each call's peak as a dot;
`card_tables` gives the report's placement/swap section and per-step table.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rewardstack._telemetry.rundir import EVENTS, ON_CARD, SUMMARY, read_incidents, read_jsonl, read_timeline

MIB = 1024**2
PLOTS = [
    ("card_over_steps.png", "The card per step: weights, activations, fragmentation, swaps and OOMs"),
    ("memory_over_time.png", "Memory over time"),
    ("peak_by_model.png", "Peak by model"),
    ("peak_vs_tokens.png", "Measured peak against padded tokens, with the cost model's prediction"),
    ("step_time_by_model.png", "Step time split by model"),
    ("completions_by_status.png", "Completions by status over time"),
]
PROFILING_COLOR = "#bcbd22"  # olive: neither a model's colour nor the grey of the rest of the step
STATUS_COLORS = {"ok": "#2ca02c", "truncated": "#1f77b4", "failed": "#7f7f7f", "oom": "#d62728", "error": "#ff7f0e"}


class RunData:
    """Everything a report reads from one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no run directory at {self.root}")
        records = list(read_timeline(self.root))
        by: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for rec in records:
            by[rec.get("type")].append(rec)
        self.start = by["start"][0] if by["start"] else None
        self.calls, self.steps, self.ooms = by["call"], by["step"], by["oom"]
        self.moves, self.alarms, self.profiles = by["placement"], by["alarm"], by["profiling"]
        events = self.root / EVENTS
        self.events = list(read_jsonl(events)) if events.exists() else []
        summary = self.root / SUMMARY
        self.summary: dict[str, Any] = json.loads(summary.read_text(encoding="utf-8")) if summary.exists() else {}
        self.incidents = read_incidents(self.root)
        times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
        self.t0 = self.start["time"] if self.start else (min(times) if times else time.time())
        self.models = list(dict.fromkeys(c["model"] for c in self.calls))
        """Model names seen in call records, in first-seen order."""


# -- plots ------------------------------------------------------------------------------------
def pyplot():  # noqa: ANN202
    """matplotlib's pyplot, headless, with the report's style (the card picture shares it)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def model_colors(models: list[str]) -> dict[str, Any]:
    """One stable colour per model, the same in every picture of the report."""
    plt = pyplot()
    cmap = plt.get_cmap("tab10" if len(models) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(models)}


def input_name(call: dict[str, Any]) -> str:
    """The input that set a call's padded length, by the step's completion index (`longest`): the
    numbering of `events.jsonl` and every other record; the prompt (relevance embeds it); or, from
    a scorer that did not name its inputs, its own index, said to be the scorer's."""
    lg = call.get("longest") or {}
    if lg.get("completion") is not None:
        return f"completion {lg['completion']}"
    if call.get("completions") is not None:
        return "the prompt"
    return f"the scorer's input {lg.get('input')}"


def plot_memory(d: RunData, plt: Any) -> Any:
    """Memory at rest per step, each call's peak by model, every OOM, the budget line; host RSS below."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    colors = model_colors(d.models)
    rest = [(s["time"] - d.t0, s["rest"].get("allocated")) for s in d.steps if s.get("rest", {}).get("allocated") is not None]
    if rest:
        ax.step([t for t, _ in rest], [v / MIB for _, v in rest], where="post", color="black", lw=1.5, label="allocated at rest (after each step)")
    for m in d.models:
        pts = [(c["time"] - d.t0, (c["start_bytes"] + c["peak_bytes"]) / MIB) for c in d.calls
               if c["model"] == m and c.get("peak_bytes") is not None and c.get("start_bytes") is not None]
        if pts:
            ax.scatter([t for t, _ in pts], [v for _, v in pts], s=14, color=colors[m], alpha=0.75, label=f"{m} call peak")
    # The budget on the memory axis, when one was set: the latest step's, else the start record's.
    budget = next((float(r["budget_line_bytes"]) for r in [*reversed(d.steps), d.start or {}]
                   if r.get("budget_line_bytes") is not None), None)
    if budget is not None:
        ax.axhline(budget / MIB, color="red", ls="--", lw=1.5, label=f"budget ({budget / MIB:,.0f} MiB)")
    oom_calls = [c for c in d.calls if c.get("outcome") in ("split", "cpu_fallback", "oom")]
    if oom_calls:
        y = budget / MIB if budget is not None else max((v for _, v in rest), default=0) / MIB
        ax.scatter([c["time"] - d.t0 for c in oom_calls], [y] * len(oom_calls), marker="X", s=90, color="red",
                   edgecolor="black", zorder=5, label=f"OOM ({len(oom_calls)})")
    for k, p in enumerate(d.profiles):  # a cost-model profile inside a run: the time it held the step
        start = p["time"] - d.t0
        for a in (ax, ax2):
            a.axvspan(start, start + (p.get("seconds") or 0.0), color=PROFILING_COLOR, alpha=0.25, lw=0,
                      label=f"profiling ({len(d.profiles)}, {sum(q.get('seconds') or 0.0 for q in d.profiles):.1f} s)"
                      if k == 0 and a is ax else None)
    ax.set_ylabel("device memory (MiB)")
    ax.set_title("Device memory over time (simulated device on CPU): at rest, each model call's peak, OOMs, profiling")
    if ax.get_legend_handles_labels()[0]:  # a run with no step has nothing to label
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: never over the data
    rss = [(s["time"] - d.t0, s["rest"].get("host_rss")) for s in d.steps if s.get("rest", {}).get("host_rss") is not None]
    if rss:
        ax2.plot([t for t, _ in rss], [v / MIB for _, v in rss], color="#555555", lw=1.2, label="process RSS at rest")
        ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax2.set_ylim(bottom=0)  # from 0: a few MiB of wiggle must not look like a leak
    ax2.set_ylabel("host RSS (MiB)")
    ax2.set_xlabel("time since the run started (s)")
    return fig


def plot_peak_by_model(d: RunData, plt: Any) -> Any:
    """Highest and median call peak per model."""
    models = d.models
    peaks = {m: [c["peak_bytes"] / MIB for c in d.calls if c["model"] == m and c.get("peak_bytes") is not None] for m in models}
    models = [m for m in models if peaks[m]]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.55 * len(models) + 1.5)))
    if models:
        ys = range(len(models))
        mx = [max(peaks[m]) for m in models]
        med = [statistics.median(peaks[m]) for m in models]
        ax.barh(ys, mx, color="#1f77b4", label="highest call peak")
        ax.barh(ys, med, color="#aec7e8", height=0.45, label="median call peak")
        for y, v in zip(ys, mx):
            ax.text(v, y, f" {v:,.1f} MiB", va="center", fontsize=9)
        ax.set_yticks(list(ys), models)
        ax.invert_yaxis()
        ax.set_xlim(0, max(mx) * 1.2)  # room for the value labels
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
    else:
        ax.text(0.5, 0.5, "no measured call peaks", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("peak above memory at the call's start (MiB)")
    ax.set_title("Peak memory by model (per planned batch)")
    return fig


def plot_peak_vs_tokens(d: RunData, plt: Any) -> Any:
    """Per model: measured peak against padded tokens (batch x length), prediction drawn over it."""
    models = [m for m in d.models if any(c.get("peak_bytes") is not None for c in d.calls if c["model"] == m)]
    n = max(1, len(models))
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1, 3.6 * rows + 0.8), squeeze=False)
    for ax, m in zip(axes.flat, models):
        cs = [c for c in d.calls if c["model"] == m and c.get("peak_bytes") is not None]
        ax.scatter([c["padded_tokens"] for c in cs], [c["peak_bytes"] / MIB for c in cs], s=16, color="#1f77b4", alpha=0.7, label="measured")
        # One prediction per call, at the same padded tokens: the model's terms in B and L apart mean
        # calls with equal B x L can differ, so the predictions are marked, not joined by a line.
        pred = [(c["padded_tokens"], c["predicted_bytes"] / MIB) for c in cs if c.get("predicted_bytes") is not None]
        if pred:
            ax.scatter([t for t, _ in pred], [v for _, v in pred], color="#d62728", marker="_", s=160, lw=2,
                       label="cost model prediction")
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("padded tokens (batch × length)", fontsize=9)
        ax.set_ylabel("peak (MiB)", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")  # outliers sit high: keep the top clear
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    if not models:
        axes.flat[0].text(0.5, 0.5, "no measured call peaks", ha="center", va="center", transform=axes.flat[0].transAxes)
    fig.suptitle("Measured peak against padded tokens per model, the cost model's prediction for each call in red")
    return fig


def plot_step_time(d: RunData, plt: Any) -> Any:
    """Seconds per step inside each model's calls, and the rest of the step."""
    models = sorted({m for s in d.steps for m in s.get("models", {})})
    colors = model_colors(models)
    fig, ax = plt.subplots(figsize=(13, 4.5))
    xs = [s["step"] for s in d.steps]
    series = {m: [s.get("models", {}).get(m, {}).get("seconds", 0.0) for s in d.steps] for m in models}
    # A profile runs inside the step but outside every model call: its own band, not the grey rest.
    profiling = [s.get("profiling_seconds") or 0.0 for s in d.steps]
    other = [max(0.0, (s.get("seconds") or 0.0) - sum(series[m][i] for m in models) - profiling[i])
             for i, s in enumerate(d.steps)]
    bands = [(m, series[m], colors[m]) for m in models]
    if any(profiling):
        bands.append((f"profiling (cost model, {sum(profiling):.1f} s)", profiling, PROFILING_COLOR))
    bands.append(("outside model calls", other, "#dddddd"))
    if xs:
        if len(xs) <= 80:
            bottom = [0.0] * len(xs)
            for label, vals, color in bands:
                ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.8)
                bottom = [b + v for b, v in zip(bottom, vals)]
        else:
            ax.stackplot(xs, *[v for _, v, _ in bands], labels=[label for label, _, _ in bands],
                         colors=[c for _, _, c in bands])
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("time (s)")
    ax.set_title("Step time split by model (time inside each model's forward passes), profiling and the rest")
    return fig


def plot_statuses(d: RunData, plt: Any) -> Any:
    """Completions per status, step after step (from the events, which are never dropped)."""
    counts = [Counter(e.get("statuses", [])) for e in d.events]
    statuses = [s for s in STATUS_COLORS if any(c[s] for c in counts)] + sorted({s for c in counts for s in c} - set(STATUS_COLORS))
    fig, ax = plt.subplots(figsize=(13, 4.2))
    xs = list(range(1, len(counts) + 1))
    if xs and statuses:
        bottom = [0] * len(xs)
        for st in statuses:  # counts are whole numbers per step: stacked bars, not an interpolated area
            vals = [c[st] for c in counts]
            ax.bar(xs, vals, bottom=bottom, width=0.85, color=STATUS_COLORS.get(st, "#9467bd"), label=st)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.set_xlabel("step (line of events.jsonl)")
    ax.set_ylabel("completions (count)")
    ax.set_title("Completions by status over time")
    return fig


# -- the card -------------------------------------------------------------------------------------
def _steps_with_card(d: Any) -> list[dict[str, Any]]:
    return [s for s in d.steps if isinstance(s.get("card"), dict)]


def weight_bands(cards: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per model, its weights on the card at each step (bytes; 0 off the card): the chart's bands.
    Each checkpoint is counted once (`counted_bytes`), so the bands add up to `weights_on_card`;
    a record from before `counted_bytes` counts each model whole."""
    def counted(w: dict[str, Any]) -> int:
        return int(w.get("counted_bytes", w.get("bytes", 0))) if w.get("state") in ON_CARD else 0

    return {m: [counted(c["weights"].get(m, {})) for c in cards] for m in dict.fromkeys(m for c in cards for m in c["weights"])}


def plot_card(d: Any, plt: Any) -> Any:
    """The card over steps: weights per model, activations, fragmentation, against its size."""
    steps = _steps_with_card(d)
    fig, ax = plt.subplots(figsize=(13, 6))
    if not steps:
        ax.text(0.5, 0.5, "no per-step card account in this run's timeline", ha="center", va="center", transform=ax.transAxes)
        return fig
    xs = [s["step"] for s in steps]
    edges = [x - 0.5 for x in xs] + [xs[-1] + 0.5]
    last = steps[-1]["card"]
    _draw_memory(ax, steps, edges, last)
    ymax = _draw_calls(ax, d, steps)
    ax.grid(axis="x", visible=False)
    for e in edges:  # step boundaries
        ax.axvline(e, color="#777777", lw=0.6, alpha=0.7)
    every = max(1, len(xs) // 25)
    ax.set_xticks(xs[::every])
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, ymax)
    ax.set_xlabel("step (vertical lines: step boundaries; dots: each model call's peak, in call order)")
    ax.set_ylabel("device memory (MiB)")
    src = "simulated device (CPU)" if last.get("source") == "tracker" else "CUDA allocator" if last.get("source") == "cuda" else "host"
    host = last.get("weights_host") or 0
    ax.set_title(f"The card per step ({src}): weights, activations, fragmentation"
                 + (f"; {host / MIB:,.1f} MiB of weights on the host" if host else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


def _draw_memory(ax: Any, steps: list[dict[str, Any]], edges: list[float], last: dict[str, Any]) -> None:
    """The stacked bands (each model's weights, activations, fragmentation) and the lines they must stay under."""
    bands = weight_bands([s["card"] for s in steps])
    # Model -> the models it shares a checkpoint with (from the last record that says).
    shares = {m: list(w["shared_with"]) for s in steps for m, w in s["card"]["weights"].items() if w.get("shared_with")}
    models = list(bands)
    colors = model_colors(models)

    def band(values: list[float]) -> list[float]:
        return values + [values[-1]]  # drawn with step="post" over each step's full width

    base = [0.0] * len(steps)
    for m in models:
        swapped = any(s["card"]["weights"].get(m, {}).get("state") in ("swapped_in", "swapped_out") for s in steps)
        vals = [b / MIB for b in bands[m]]
        shared = f" (shared with {', '.join(shares[m])})" if m in shares else ""
        if not any(vals):
            if shared and any(s["card"]["weights"].get(m, {}).get("state") in ON_CARD for s in steps):
                # On the card, its checkpoint counted in another model's band: said, not drawn twice.
                ax.plot([], [], " ", label=f"{m}: its weights are {shares[m][0]}'s, counted there")
            continue
        top = [b + v for b, v in zip(base, vals)]
        ax.fill_between(edges, band(base), band(top), step="post", color=colors[m], alpha=0.55,
                        hatch="//" if swapped else None,
                        label=f"{m} weights on the card after the step{shared}" + (" (swapped)" if swapped else ""))
        base = top
    act = [(s["card"].get("activation_peak") or 0) / MIB for s in steps]
    top = [b + v for b, v in zip(base, act)]
    # Cross-hatched on white: tab10's red is also the fourth model's weights colour.
    ax.fill_between(edges, band(base), band(top), step="post", facecolor="white", edgecolor="#444444", hatch="xx",
                    linewidth=0.0, label="activations (step's peak call)")
    base = top
    frag = [max(0, s["card"].get("fragmentation") or 0) / MIB for s in steps]
    if any(frag):
        top = [b + v for b, v in zip(base, frag)]
        ax.fill_between(edges, band(base), band(top), step="post", color="#7f7f7f", alpha=0.4,
                        label="fragmentation (reserved, no tensor)")
    if last.get("capacity"):
        ax.axhline(last["capacity"] / MIB, color="black", lw=1.5, label=f"card size ({last['capacity'] / MIB:,.0f} MiB)")
    if not last.get("capacity") and last.get("weight_budget"):
        ax.axhline(last["weight_budget"] / MIB, color="black", ls=":", lw=1.5,
                   label=f"weight budget ({last['weight_budget'] / MIB:,.0f} MiB; activations have their own)")
    if last.get("activation_budget") is not None:
        line = [(s["card"]["weights_on_card"] + s["card"]["activation_budget"]) / MIB for s in steps]
        ax.step(edges, band(line), where="post", color="red", ls="--", lw=1.3, label="weights on card + activation budget")


def _draw_calls(ax: Any, d: Any, steps: list[dict[str, Any]]) -> float:
    """Each call's peak as a dot, swaps and OOMs as marks along the top; returns the chart's height (MiB)."""
    # Per-call peaks, spread across their step's width in call order.
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for c in d.calls:
        if c.get("peak_bytes") is not None and c.get("step") is not None:
            by_step[c["step"]].append(c)
    woc = {s["step"]: s["card"]["weights_on_card"] for s in steps}
    call_colors = model_colors(d.models)
    for k, cs in by_step.items():
        if k not in woc:
            continue
        for j, c in enumerate(cs):
            x = k - 0.4 + 0.8 * (j + 0.5) / len(cs)
            ax.scatter([x], [(woc[k] + c["peak_bytes"]) / MIB], s=12, color=call_colors[c["model"]], edgecolor="black",
                       linewidth=0.3, zorder=4)
    ymax = ax.get_ylim()[1]
    swaps = Counter(m.get("step") for m in d.moves if m.get("direction") == "in")  # weights moved onto the card
    if swaps:
        sx = [k for k in swaps if k in woc]
        ax.scatter(sx, [ymax * 0.97] * len(sx), marker="v", s=50, color="#1f77b4", zorder=5,
                   label=f"swap: weights moved onto the card ({sum(swaps[k] for k in sx)})")
    ooms = Counter(o.get("step") for o in d.ooms)
    if ooms:
        ox = [k for k in ooms if k in woc]
        ax.scatter(ox, [ymax * 0.92] * len(ox), marker="X", s=90, color="red", edgecolor="black", zorder=6,
                   label=f"OOM ({sum(ooms[k] for k in ox)})")
    return ymax


def _m(x: Any) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


def _table(title: str, head: list[str], rows: list[list[Any]], after: str = "") -> str:
    """One HTML section: a title, a table (each cell escaped) and a paragraph after it."""
    def cells(tag: str, xs: list[Any]) -> str:
        return "".join(f"<{tag}>{html.escape(str(x))}</{tag}>" for x in xs)

    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<h2>{title}</h2><table><tr>{cells('th', head)}</tr>{body}</table>{after}"


def card_tables(d: RunData) -> str:
    """HTML: placement and swaps (per model), one row per step, and the top inputs per model."""
    steps = _steps_with_card(d)
    parts: list[str] = []
    if steps:
        last = steps[-1]["card"]
        moves = Counter(m.get("model") for m in d.moves)
        parts.append(_table("Placement and swaps", [
            "model", "where (last step)", "weights MiB", "counted MiB (each checkpoint once)", "shares its checkpoint with",
            "steps swapped in", "moves"], [
            [m, w["state"], _m(w["bytes"]), _m(w.get("counted_bytes", w["bytes"])),
             ", ".join(w.get("shared_with") or []) or "-",
             sum(1 for s in steps if s["card"]["weights"].get(m, {}).get("state") == "swapped_in"), moves.get(m, 0)]
            for m, w in last["weights"].items()],
            f"<p>card {_m(last.get('capacity'))} MiB, activation budget {_m(last.get('activation_budget'))} MiB, "
            f"headroom {_m(last.get('headroom'))} MiB, weights on the card {_m(last.get('weights_on_card'))} MiB, "
            f"on the host {_m(last.get('weights_host'))} MiB</p>"))
        oom_by = Counter(o.get("step") for o in d.ooms)
        rows = []
        for s in steps:
            c = s["card"]
            left = None if c.get("capacity") is None else c["capacity"] - c["weights_on_card"] - (c.get("activation_peak") or 0)
            rows.append([s["step"], s.get("name"), f"{(s.get('seconds') or 0):.2f}", _m(c["weights_on_card"]),
                         _m(c.get("activation_peak")), _m(c.get("allocated")), _m(c.get("reserved")), _m(left),
                         oom_by.get(s["step"], 0), ", ".join(f"{k} {v}" for k, v in sorted((s.get("statuses") or {}).items()))])
        parts.append(_table("Per step", ["step", "name", "s", "weights on card MiB", "activation peak MiB", "allocated MiB",
                                         "reserved MiB", "headroom left MiB", "OOMs", "statuses"], rows))
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in d.calls:
        if c.get("peak_bytes") is not None and not c.get("on_host"):  # a host call has no device peak
            per[c["model"]].append(c)
    rows = [[m, c.get("step"), _m(c["peak_bytes"]), f"{c.get('batch')} x {c.get('padded_length')}", input_name(c),
             (c.get("longest") or {}).get("length"), ((c.get("longest") or {}).get("head") or "")[:60]]
            for m, cs in per.items() for c in sorted(cs, key=lambda c: -c["peak_bytes"])[:3]]
    if rows:
        parts.append(_table("Top inputs per model", [
            "model", "step", "peak MiB", "batch x tokens", "longest input (the step's completion index)", "its tokens",
            "its start"], rows))
    return "\n".join(parts)


# -- the summary ------------------------------------------------------------------------------
def _mib(x: Any) -> str:
    return "n/a" if x is None else f"{x / MIB:,.1f} MiB"


def summarize(d: RunData) -> dict[str, list[str]]:
    """The summary's sections, as lines of text."""
    s = d.summary
    steps = s.get("steps", len(d.steps))
    run = [f"{steps} steps, {sum(len(e.get('statuses', [])) for e in d.events)} completions in events.jsonl; "
           f"device {s.get('device', (d.start or {}).get('device', '?'))}; budget {_mib(s.get('budget_bytes'))}"]
    if not steps:
        # Seen walking the README: a second `score ... --run-dir D` onto an output that already held
        # every step resumed after them and scored none, and the report was empty without a word why.
        run.append("no step was scored in this run folder: a run folder records the steps its `score` scores, "
                   "and a `score` that resumes after steps already in its --output scores none of them again; "
                   "give --run-dir to the run that scores them (a new --output and state_dir)")
    # The calls with the highest peaks: the timeline's, or the summary's when the timeline rotated.
    top = sorted((c for c in d.calls if c.get("peak_bytes") is not None), key=lambda c: -c["peak_bytes"])
    peaks = []
    for c in top[:5] or d.summary.get("top_calls", [])[:5]:
        lg = c.get("longest") or {}
        head = (lg.get("head") or "")[:60].replace("\n", " ")
        peaks.append(f"step {c.get('step')} {c.get('model')}: peak {_mib(c.get('peak_bytes'))} "
                     f"(predicted {_mib(c.get('predicted_bytes'))}), batch {c.get('batch')} x {c.get('padded_length')} tokens; "
                     f"longest: {input_name(c)}, {lg.get('length')} tokens, \"{head}\"")
    by = Counter((c["model"], c["outcome"]) for c in d.calls if c.get("outcome") in ("split", "cpu_fallback", "oom"))
    ooms = [f"{m}: {k} x {o}" for (m, o), k in sorted(by.items())]
    for inc in d.incidents[-5:]:
        first = (inc.get("inputs") or [{}])[0]
        ooms.append(f"incident {inc['file']}: step {inc.get('step')} {inc.get('model')} {inc.get('action')}, "
                    f"{len(inc.get('inputs', []))} input(s), first: completion {first.get('completion')}, "
                    f"{first.get('length')} tokens, \"{(first.get('head') or '')[:50]}\"")
    verdict = s.get("alarms") or {}
    leak = [a.get("message") or f"{a.get('series')} trended up" for a in d.alarms] or [
        f"{t.get('series')}: {t.get('slope', 0) / MIB:+.3f} MiB/step" for t in verdict.get("trends") or []]
    if not leak:
        slopes = {k: v for k, v in (verdict.get("slopes") or {}).items() if v is not None}
        detail = "; ".join(f"{k} {v / MIB:+.4f} MiB/step" if k != "inactive_split_share" else f"{k} {v:+.5f}/step"
                           for k, v in slopes.items())
        leak = ["no leak or fragmentation alarm" + (f" (last slopes: {detail})" if detail else " (window not yet full)")]
    errs: dict[str, list[float]] = defaultdict(list)
    for c in d.calls:
        # a call in host memory has no device peak to compare: its "-100%" would be a false alarm
        if c.get("error_ratio") is not None and not c.get("on_host"):
            errs[c["model"]].append(c["error_ratio"])
    cost = [f"{m}: mean |error| {100 * statistics.fmean(abs(x) for x in e):.1f}%, max |error| "
            f"{100 * max(abs(x) for x in e):.1f}%, median {100 * statistics.median(e):+.1f}% over {len(e)} calls"
            for m, e in sorted(errs.items())] or [
        f"{m}: mean |error| {100 * v['cost_model_mean_abs_error']:.1f}%"
        for m, v in sorted((s.get("models") or {}).items()) if v.get("cost_model_mean_abs_error") is not None]
    profiling = [f"step {p.get('step')} {p.get('name')}: {p.get('seconds', 0.0):.1f} s profiling, {p.get('shapes')} shapes"
                 for p in d.profiles]
    if profiling:
        profiling.insert(0, f"{len(d.profiles)} profiles inside steps, {sum(p.get('seconds') or 0.0 for p in d.profiles):.1f} s in all")
    return {"Run": run, "Top inputs behind the peaks": peaks or ["no measured peaks"], "OOMs": ooms or ["no OOM"],
            "Profiling inside steps": profiling or ["none: every cost model came from the load-time calibration"],
            "Leak verdict": leak, "Cost model error (measured vs predicted peak)": cost or ["no predictions to compare"]}


def _html(d: RunData, sections: dict[str, list[str]], out_dir: Path, tables: str) -> str:
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>rewardstack run report</title>",
             "<style>body{font-family:sans-serif;max-width:1300px;margin:20px auto;color:#222}"
             "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ccc}"
             "ul{font-size:14px;line-height:1.5}img{max-width:100%;border:1px solid #ddd}"
             "code{background:#f4f4f4}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style></head><body>",
             f"<h1>rewardstack run report: <code>{html.escape(str(d.root))}</code></h1>"]
    for title, lines in sections.items():
        parts.append(f"<h2>{html.escape(title)}</h2><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in lines) + "</ul>")
    for name, title in PLOTS:
        data = base64.b64encode((out_dir / name).read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")
    parts += [tables, "</body></html>"]
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    """Write the PNGs and report.html; return (the page's path, the summary text)."""
    d = RunData(run_dir)
    out_dir = Path(out) if out is not None else d.root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers = [plot_card, plot_memory, plot_peak_by_model, plot_peak_vs_tokens, plot_step_time, plot_statuses]
    plt = pyplot()
    for (name, _), draw in zip(PLOTS, drawers):  # each drawer returns its figure, laid out, written and closed here
        fig = draw(d, plt)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
    sections = summarize(d)
    page = out_dir / "report.html"
    page.write_text(_html(d, sections, out_dir, card_tables(d)), encoding="utf-8")
    text = "\n".join(f"{title}:\n" + "\n".join(f"  - {x}" for x in lines) for title, lines in sections.items())
    return page, text


def cmd_report(args: argparse.Namespace) -> int:
    """`rewardstack report RUN_DIR [--out DIR]`."""
    page, text = write_report(args.run_dir, args.out)
    print(text)
    print(f"report: {page}")
    return 0
