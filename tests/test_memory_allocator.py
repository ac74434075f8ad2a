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
    assert maybe_empty_cache("cuda", 1000, stats=_stats(1500, 1000, 10), empty=calls.append) is None and not calls
    why = maybe_empty_cache("cuda", 1000, stats=_stats(3000, 1000, 10), empty=calls.append)
    assert why is not None and len(calls) == 1 and "reserved-allocated 2000 > 1000" in why
    why = maybe_empty_cache("cuda", 1000, stats=_stats(1200, 1000, 600), empty=calls.append)
    assert why is not None and "inactive split 600 > 500" in why and len(calls) == 2


def test_cpu_is_a_no_op() -> None:
    assert maybe_empty_cache("cpu") is None
