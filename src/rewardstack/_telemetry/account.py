"""The card's whole account at one moment: what the telemetry monitor records in each step (`card`).

The weights of every model by where they are (resident on the card, swapped in for this step, on
the host), each loaded checkpoint counted once where models share it (`counted_bytes`,
`shared_with`: the stand-ins' diversity mask loads relevance's second model, counted for
relevance), the step's activation peak (the largest call's peak above what was live when it
began), the allocator's reserved and allocated bytes (their difference is fragmentation: memory
the cache holds with no tensor in it), the headroom kept free, the activation budget and the
card's size. On CPU the card is the simulated device (the tensor-bytes tracker): no cache, so
reserved equals allocated, and its size is the budget the weights were placed into.

Runtime only: the report draws these records (card.py) and nothing here draws.
"""

from __future__ import annotations

from typing import Any

ON_CARD = ("resident", "swapped_in")
"""The weight states that occupy the card."""


def card_account(memory: Any, snap: Any, activation_peak: int | None) -> dict[str, Any]:
    """The device's account now, as the step record's `card` entry (bytes; None: not measured)."""
    placement = memory.placement.summary() if getattr(memory, "placement", None) is not None else {}
    swapped_in = set(placement.get("swapped_in", []))
    weights: dict[str, dict[str, Any]] = {}
    for name, d in (placement.get("models") or {}).items():
        where = d["where"]
        state = "resident" if where == "resident" else "swapped_in" if (where == "swap" and name in swapped_in) \
            else "swapped_out" if where == "swap" else "host"
        # `bytes`: the model's whole size; `counted_bytes`: what it adds to the stack's weights
        # (placement counts a module shared by several models once, for one of them).
        weights[name] = {"state": state, "bytes": int(d["bytes"]), "counted_bytes": int(d.get("counted_bytes", d["bytes"])),
                         "shared_with": list(d.get("shared_with", []))}
    budget = getattr(memory, "budget", None)
    # The card's size: None on CPU without device_memory, where memory_budget is both the weight
    # budget placement packs into and, separately, the activation budget (weights are not charged).
    capacity = getattr(budget, "total_bytes", None)
    return {
        "source": getattr(snap, "source", None),
        "weights": weights,
        "weights_on_card": sum(w["counted_bytes"] for w in weights.values() if w["state"] in ON_CARD),
        "weights_host": sum(w["counted_bytes"] for w in weights.values() if w["state"] not in ON_CARD),
        "activation_peak": activation_peak,
        "allocated": getattr(snap, "allocated", None),
        "reserved": getattr(snap, "reserved", None),
        "fragmentation": snap.fragmentation if snap is not None else None,
        "headroom": getattr(budget, "headroom_bytes", None),
        "activation_budget": getattr(memory, "budget_bytes", None),
        "capacity": capacity,
        "weight_budget": placement.get("budget_bytes"),
        "swaps": placement.get("swaps"),
    }


__all__ = ["ON_CARD", "card_account"]
