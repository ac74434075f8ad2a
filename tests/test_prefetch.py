"""The stack prefetches the model it runs next, once the current one is placed (issue 19).

On CUDA with pinned host copies `Placement.prefetch` starts the next swapped model's copy on a side
stream while the current model computes (measured by the GPU check); on CPU it declines. What is
checked here is the stack's part, the same on every device: which model it asks for, and when.
"""

from __future__ import annotations

from pathlib import Path

from conftest import standin_config

from rewardstack._memory.budget import weights_bytes
from rewardstack.stack import RewardStack


def test_each_model_prefetches_its_successor_after_it_is_placed(tiny_standins: Path, tmp_path: Path) -> None:
    probe = RewardStack(standin_config(tiny_standins, tmp_path / "p"), load_state=False)
    total = weights_bytes([m for s in probe.scorers.values() for m in s.modules()])
    stack = RewardStack(standin_config(tiny_standins, tmp_path / "s", memory_budget=total // 2), load_state=False)
    placement = stack.memory.placement
    assert placement is not None
    calls: list[tuple[str, str]] = []
    ensure, prefetch = placement.ensure, placement.prefetch

    def record_ensure(name: str):  # noqa: ANN202
        calls.append(("ensure", name))
        return ensure(name)

    def record_prefetch(name: str) -> bool:
        calls.append(("prefetch", name))
        return prefetch(name)

    placement.ensure, placement.prefetch = record_ensure, record_prefetch  # type: ignore[method-assign]
    stack.score_step({"name": "augment", "prompt": "Summarize the text about rivers.",
                      "completions": ["Rivers carry water to the sea.", "The sea is salty."]}, save=False)

    ran = [n for kind, n in calls if kind == "ensure"]
    order = list(dict.fromkeys(ran))  # the models in the order they first ran
    assert len(order) >= 4, order
    fetched = [n for kind, n in calls if kind == "prefetch"]
    # Each model but the last asks for its successor before that one runs (diversity runs on
    # relevance's encoder, so its passes are placed as relevance_filter), never for itself.
    for cur, nxt in zip(order, order[1:]):
        i_cur = calls.index(("ensure", cur))
        i_next = calls.index(("ensure", nxt))
        between = [n for kind, n in calls[i_cur:i_next] if kind == "prefetch"]
        assert between and between[-1] == nxt, (cur, nxt, calls[i_cur:i_next])
    assert all(kind != "prefetch" or n != prev for (kind, n), (_, prev) in zip(calls[1:], calls))
    assert stack.memory.up_next is None  # after the step, a profile pass prefetches nothing
