"""What every picture and table of the report shares: pyplot headless, one colour per model, one way
to save a figure, one way to name an input."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out, write and close one figure (every plot of the report ends so)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


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


__all__ = ["input_name", "model_colors", "pyplot", "save_figure"]
