"""No valid input makes the state unsaveable: long non-ASCII texts at the limits, and what is kept bounded.

Up to state format 2 the JSON part of the state lived in the safetensors header, capped at 100 MB,
with every non-ASCII character escaped (an emoji took 12 bytes): one step of 130 completions of
65,536 emoji made `score` fail with "header too large" on every rerun. Format 3 keeps it in the
file's body as UTF-8; the answers kept for retries are bounded in bytes as well as in number.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from pathlib import Path

from rewardstack.config import from_dict
from rewardstack._service.errors import ServiceError
from rewardstack._service.namespaces import admit
from rewardstack._wire import RECENT_BYTES, RECENT_RESULTS
from rewardstack._state import FORMAT_VERSION, RewardState, StateStore

EMOJI = "\U0001F600"  # 4 bytes in UTF-8, 12 in an ASCII-escaped JSON string
MAX_COMPLETIONS, MAX_CHARS = 256, 65_536  # [input] max_completions and max_chars: the largest step admitted


def worst_answer(sequence: int) -> str:
    """A kept answer as large as the limits admit: every completion `max_chars` emoji long, echoed."""
    completion = EMOJI * MAX_CHARS
    return json.dumps({"name": "augment", "completions": [completion] * MAX_COMPLETIONS, "sequence": sequence},
                      ensure_ascii=False)


def test_a_state_holding_the_largest_step_admitted_saves_and_loads(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    answer = worst_answer(1)
    assert len(answer.encode()) > 64 * 2**20  # 67 MB of UTF-8: 200 MB escaped, past the old header cap
    store.save({"stack": {"steps_scored": 1, "recent": {"1": answer}},
                "diversity_reward_model": {"history": torch.ones(4, 3)}})
    back = StateStore(tmp_path).load()
    assert back["stack"]["recent"]["1"] == answer
    assert torch.equal(back["diversity_reward_model"]["history"], torch.ones(4, 3))
    assert store.path.stat().st_size < 1.1 * len(answer.encode())  # UTF-8 as is, not escaped


def test_kept_answers_stay_bounded_over_many_worst_case_steps(tmp_path: Path) -> None:
    state = RewardState(from_dict({"device": "cpu", "state_dir": str(tmp_path)}))
    store = StateStore(tmp_path)
    big = 20 * 2**20  # four answers of 20 MiB pass the 64 MiB bound
    for seq in range(1, 9):
        state.steps_scored = seq
        state.remember(seq, f'{{"sequence": {seq}, "t": "' + "x" * big + '"}')
        kept = sum(len(r.encode()) for r in state.recent.values())
        assert kept <= RECENT_BYTES and seq in state.recent  # the newest is always kept
    assert list(state.recent) == [6, 7, 8]
    with pytest.raises(ServiceError, match="no longer kept"):  # pushed out: a retry of it is told so, not answered wrongly
        admit(state, "n", None, sequence=5, epoch=None, expected=9, max_chars=None)  # type: ignore[arg-type]
    store.save(state.state_dict())
    again = RewardState(from_dict({"device": "cpu", "state_dir": str(tmp_path)}))
    again.load_state_dict(StateStore(tmp_path).load())
    assert list(again.recent) == [6, 7, 8]
    again.steps_scored = 9
    again.remember(9, '{"sequence": 9}')  # counted again after a load
    assert list(again.recent) == [6, 7, 8, 9]
    # One worst-case answer alone is kept whole (the newest always is): bounded per step by the limits.
    again.remember(10, worst_answer(10))
    assert list(again.recent) == [10]


def test_many_small_answers_are_bounded_by_count(tmp_path: Path) -> None:
    state = RewardState(from_dict({"device": "cpu", "state_dir": str(tmp_path)}))
    for seq in range(1, RECENT_RESULTS + 11):
        state.remember(seq, f'{{"sequence": {seq}}}')
    assert list(state.recent) == list(range(11, RECENT_RESULTS + 11))
    assert isinstance(state.recent, OrderedDict)


def test_a_format_2_state_still_loads_and_is_kept_beside_its_upgrade(tmp_path: Path) -> None:
    from safetensors.torch import save

    store = StateStore(tmp_path)
    sections = {"normalizers": {"x": {"count": 2, "mean": 0.5, "var": 1.0}}, "stack": {"recent": {"1": "caf\u00e9"}}}
    meta = {"rewardstack_json": json.dumps({"version": 2, "sections": sections})}
    store.path.write_bytes(save({"diversity_reward_model/history": torch.ones(2, 2)}, metadata=meta))
    back = store.load()
    assert store.loaded_version == 2 and back["stack"]["recent"]["1"] == "caf\u00e9"
    store.save(back)
    assert (tmp_path / "state.v2.safetensors").exists()
    again = StateStore(tmp_path)
    assert again.load()["normalizers"]["x"]["count"] == 2 and again.loaded_version == FORMAT_VERSION == 3
