"""Tests of the allocator settings and the fragmentation-driven cache emptying (injected stats)."""

from __future__ import annotations

from rewardstack._memory.device import ENV, configure_allocator, maybe_empty_cache


def test_sets_expandable_segments_unless_user_chose() -> None:
    env: dict[str, str] = {}
    assert configure_allocator(env) == "expandable_segments:True" and env[ENV] == "expandable_segments:True"
    env = {ENV: "max_split_size_mb:128"}
    assert configure_allocator(env) == "max_split_size_mb:128" and env[ENV] == "max_split_size_mb:128"


def _stats(reserved: int, allocated: int, split: int):  # noqa: ANN202
    return lambda d: {
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.current": allocated,
        "inactive_split_bytes.all.current": split,
    }


def test_empties_only_past_thresholds() -> None:
    calls: list[object] = []
    d = maybe_empty_cache("cuda", 1000, stats=_stats(1500, 1000, 10), empty=calls.append)
    assert not d.emptied and d.fragmentation == 500 and not calls
    d = maybe_empty_cache("cuda", 1000, stats=_stats(3000, 1000, 10), empty=calls.append)
    assert d.emptied and len(calls) == 1 and "reserved-allocated" in d.reason
    d = maybe_empty_cache("cuda", 1000, stats=_stats(1200, 1000, 600), empty=calls.append)
    assert d.emptied and "inactive split" in d.reason and len(calls) == 2


def test_cpu_is_a_no_op() -> None:
    assert not maybe_empty_cache("cpu").emptied
