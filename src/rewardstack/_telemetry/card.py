"""The card's picture in the report: where the memory went, step by step.

It draws the account the monitor records in each step record (`card`, telemetry/account.py).
`plot_card` draws it as a stacked area over steps (one band per model's weights on the card,
then activations, then fragmentation), step boundaries as vertical lines, the card's size and
the weights + activation budget as horizontal lines, swaps and OOMs marked per step, each call's
peak as a dot; `card_tables` gives the report's placement/swap section and per-step table.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rewardstack._telemetry.account import ON_CARD
from rewardstack._telemetry.drawing import input_name, model_colors, pyplot, save_figure

MIB = 1024**2


def _steps_with_card(d: Any) -> list[dict[str, Any]]:
    return [s for s in d.steps if isinstance(s.get("card"), dict)]


def weight_bands(cards: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per model, its weights on the card at each step (bytes; 0 off the card): the chart's bands.
    Each checkpoint is counted once (`counted_bytes`), so the bands add up to `weights_on_card`;
    a record from before `counted_bytes` counts each model whole."""
    models = list(dict.fromkeys(m for c in cards for m in c["weights"]))
    bands: dict[str, list[int]] = {}
    for m in models:
        vals = []
        for c in cards:
            w = c["weights"].get(m, {})
            vals.append(int(w.get("counted_bytes", w.get("bytes", 0))) if w.get("state") in ON_CARD else 0)
        bands[m] = vals
    return bands


def _sharing(cards: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Model -> the models it shares a checkpoint with (from the last record that says)."""
    out: dict[str, list[str]] = {}
    for c in cards:
        for m, w in c["weights"].items():
            if w.get("shared_with"):
                out[m] = list(w["shared_with"])
    return out


def plot_card(d: Any, path: Path) -> None:
    """The card over steps: weights per model, activations, fragmentation, against its size."""
    plt = pyplot()
    steps = _steps_with_card(d)
    fig, ax = plt.subplots(figsize=(13, 6))
    if not steps:
        ax.text(0.5, 0.5, "no per-step card account in this run's timeline", ha="center", va="center", transform=ax.transAxes)
        save_figure(plt, fig, path)
        return
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
    save_figure(plt, fig, path)


def _draw_memory(ax: Any, steps: list[dict[str, Any]], edges: list[float], last: dict[str, Any]) -> None:
    """The stacked bands (each model's weights, activations, fragmentation) and the lines they must stay under."""
    bands = weight_bands([s["card"] for s in steps])
    shares = _sharing([s["card"] for s in steps])
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
    call_colors = model_colors(d.models())
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


def card_tables(d: Any) -> str:
    """HTML: placement and swaps (per model), one row per step, and the top inputs per model."""
    import html


    steps = _steps_with_card(d)
    parts: list[str] = []
    if steps:
        last = steps[-1]["card"]
        moves = Counter(m.get("model") for m in d.moves)
        rows = "".join(
            f"<tr><td>{html.escape(m)}</td><td>{html.escape(w['state'])}</td><td>{_m(w['bytes'])}</td>"
            f"<td>{_m(w.get('counted_bytes', w['bytes']))}</td><td>{html.escape(', '.join(w.get('shared_with') or []) or '-')}</td>"
            f"<td>{sum(1 for s in steps if s['card']['weights'].get(m, {}).get('state') == 'swapped_in')}</td>"
            f"<td>{moves.get(m, 0)}</td></tr>" for m, w in last["weights"].items())
        parts.append("<h2>Placement and swaps</h2><table><tr><th>model</th><th>where (last step)</th><th>weights MiB</th>"
                     "<th>counted MiB (each checkpoint once)</th><th>shares its checkpoint with</th>"
                     f"<th>steps swapped in</th><th>moves</th></tr>{rows}</table>"
                     f"<p>card {_m(last.get('capacity'))} MiB, activation budget {_m(last.get('activation_budget'))} MiB, "
                     f"headroom {_m(last.get('headroom'))} MiB, weights on the card {_m(last.get('weights_on_card'))} MiB, "
                     f"on the host {_m(last.get('weights_host'))} MiB</p>")
        oom_by = Counter(o.get("step") for o in d.ooms)
        body = "".join(
            f"<tr><td>{s['step']}</td><td>{html.escape(str(s.get('name')))}</td><td>{(s.get('seconds') or 0):.2f}</td>"
            f"<td>{_m(s['card']['weights_on_card'])}</td><td>{_m(s['card'].get('activation_peak'))}</td>"
            f"<td>{_m(s['card'].get('allocated'))}</td><td>{_m(s['card'].get('reserved'))}</td>"
            f"<td>{_m(None if s['card'].get('capacity') is None else s['card']['capacity'] - s['card']['weights_on_card'] - (s['card'].get('activation_peak') or 0))}</td>"
            f"<td>{oom_by.get(s['step'], 0)}</td>"
            f"<td>{html.escape(', '.join(f'{k} {v}' for k, v in sorted((s.get('statuses') or {}).items())))}</td></tr>"
            for s in steps)
        parts.append("<h2>Per step</h2><table><tr><th>step</th><th>name</th><th>s</th><th>weights on card MiB</th>"
                     "<th>activation peak MiB</th><th>allocated MiB</th><th>reserved MiB</th><th>headroom left MiB</th>"
                     f"<th>OOMs</th><th>statuses</th></tr>{body}</table>")
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in d.calls:
        if c.get("peak_bytes") is not None and not c.get("on_host"):  # a host call has no device peak
            per[c["model"]].append(c)
    if per:
        items = []
        for m, cs in per.items():
            for c in sorted(cs, key=lambda c: -c["peak_bytes"])[:3]:
                lg = c.get("longest") or {}
                items.append(f"<tr><td>{html.escape(m)}</td><td>{c.get('step')}</td><td>{_m(c['peak_bytes'])}</td>"
                             f"<td>{c.get('batch')} x {c.get('padded_length')}</td><td>{html.escape(input_name(c))}</td>"
                             f"<td>{lg.get('length')}</td><td>{html.escape((lg.get('head') or '')[:60])}</td></tr>")
        parts.append("<h2>Top inputs per model</h2><table><tr><th>model</th><th>step</th><th>peak MiB</th>"
                     "<th>batch x tokens</th><th>longest input (the step's completion index)</th><th>its tokens</th>"
                     "<th>its start</th></tr>" + "".join(items) + "</table>")
    return "\n".join(parts)
