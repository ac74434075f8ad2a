"""Plots (PNG, matplotlib's headless backend) and `bench/RESULTS.md` from one `python -m bench` run."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

MiB = 2**20


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    """Lay out, write the PNG, and free the figure (every plot of the page ends the same way)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def plot_length(rows: list[Any], path: Path) -> None:
    """Peak MiB against completion characters (log-log), ours against the reference, per model."""
    plt = _plt()
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for i, m in enumerate(models):
        rs = [r for r in rows if r.model == m]
        color = f"C{i}"
        ax.plot([r.chars for r in rs], [max(r.ours_bytes, 1) / MiB for r in rs], "o-", color=color, label=f"{m} (rewardstack)")
        meas = [r for r in rs if r.ref_bytes is not None]
        if meas:
            ax.plot([r.chars for r in meas], [max(r.ref_bytes, 1) / MiB for r in meas], "x--", color=color, label=f"{m} (reference)")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("completion length (characters)"), ax.set_ylabel("peak tensor memory (MiB)")
    ax.set_title("Stand-ins, measured: peak for one completion")
    ax.grid(True, which="both", alpha=0.3), ax.legend(fontsize=7)
    ax = axes[1]
    any_sim = False
    for i, m in enumerate(models):
        rs = [r for r in rows if r.model == m]
        color = f"C{i}"
        so = [r for r in rs if r.sim_ours_bytes]
        sr = [r for r in rs if r.sim_ref_bytes]
        if so:
            any_sim = True
            ax.plot([r.chars for r in so], [r.sim_ours_bytes / MiB for r in so], "o-", color=color, label=f"{m} (rewardstack)")
        if sr:
            any_sim = True
            ax.plot([r.chars for r in sr], [r.sim_ref_bytes / MiB for r in sr], "x--", color=color, label=f"{m} (reference)")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("completion length (characters, ~4 per token)"), ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title("Real models at full size, simulated (meta device)" if any_sim else "simulation unavailable")
    ax.grid(True, which="both", alpha=0.3)
    if any_sim:
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_uptime(up: dict[str, Any], path: Path) -> None:
    """Memory at rest (tracked tensors and RSS) against steps, with the diversity history's size."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = list(range(1, len(up["live"]) + 1))
    ax.plot(xs, [b / MiB for b in up["live"]], label="live tensor bytes at rest (tracker)")
    ax.plot(xs, [b / MiB for b in up["rss"]], label="process RSS")
    if up.get("history_full_at"):
        ax.axvline(up["history_full_at"], color="gray", ls=":", label="diversity history full")
    ax.set_xlabel("step"), ax.set_ylabel("memory (MiB)")
    ax.set_title("Memory at rest after each step")
    ax.grid(True, alpha=0.3), ax.legend(fontsize=8)
    _save(fig, path)


def plot_scaling(points: list[tuple[int, float]], path: Path) -> None:
    """Seconds per step against completions per step, with the linear line through the first point."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ns, ts = [p[0] for p in points], [p[1] for p in points]
    ax.plot(ns, ts, "o-", label="rewardstack")
    if points:
        ax.plot(ns, [ts[0] * n / ns[0] for n in ns], "--", color="gray", label="linear from the smallest step")
    ax.set_xlabel("completions per step"), ax.set_ylabel("step time (s)")
    ax.set_title("Step time against completions per step")
    ax.grid(True, alpha=0.3), ax.legend(fontsize=8)
    _save(fig, path)


def machine() -> str:
    """Cores, torch version and device, for the results page."""
    import os

    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return (f"{os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), device: {dev}")


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
