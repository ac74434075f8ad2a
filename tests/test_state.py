"""Atomic state: a kill at any moment leaves the old or the new state, never a broken file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rewardstack.errors import StateError
from rewardstack._state import StateLock, StateStore


def test_roundtrip(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s")
    assert store.load() == {}
    hist = torch.randn(7, 4)
    store.save({"normalizers": {"a": {"count": 3, "mean": 0.5, "var": 1.0}}, "div": {"history": hist, "n": 2}})
    got = store.load()
    assert got["normalizers"]["a"] == {"count": 3, "mean": 0.5, "var": 1.0}
    assert torch.equal(got["div"]["history"], hist) and got["div"]["n"] == 2


def test_failed_rename_keeps_old_state_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(tmp_path)
    store.save({"x": {"v": 1}})

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        store.save({"x": {"v": 2}})
    monkeypatch.undo()
    assert store.load() == {"x": {"v": 1}}
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save({"x": {"history": torch.zeros(100, 8)}})
    data = store.path.read_bytes()
    store.path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StateError):
        store.load()


WRITER = textwrap.dedent(
    """
    import sys, torch
    from rewardstack._state import StateStore
    store = StateStore(sys.argv[1])
    i = 0
    while True:
        i += 1
        # ~16 MB per save so a kill often lands mid-write.
        store.save({"gen": {"i": i}, "div": {"history": torch.full((4096, 1024), float(i))}})
        print(i, flush=True)
    """
)


def test_kill_mid_save_leaves_loadable_state(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(state_dir)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one complete save
        time.sleep(0.05 + 0.07 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = StateStore(state_dir).load()
        i = got["gen"]["i"]
        hist = got["div"]["history"]
        assert hist.shape == (4096, 1024)
        assert bool((hist == float(i)).all()), "state mixes two generations"
        assert [p.name for p in state_dir.iterdir()] == ["state.safetensors"]  # stale temps removed


def test_the_rescore_output_lock_is_a_state_lock(tmp_path) -> None:  # noqa: ANN001
    """Rescore's one-writer-per-output-folder lock is `StateLock` on another file: a second is refused."""
    pytest.importorskip("pyarrow")
    from rewardstack._distributed.rescore import output_lock
    from rewardstack.errors import ClusterError

    first = output_lock(tmp_path)
    try:
        assert isinstance(first, StateLock) and first.path.name == ".rescore.lock" and first.held
        with pytest.raises(ClusterError, match="another rescore is writing"):
            output_lock(tmp_path)
        with StateLock(tmp_path):  # the state lock of the same folder is another file
            pass
    finally:
        first.release()
    output_lock(tmp_path).release()  # released: free again


def test_the_namespace_limit_waits_on_the_same_lock(tmp_path) -> None:  # noqa: ANN001
    """`namespaces.reserve` counts and creates under `StateLock` on `.create.lock`, waiting for it
    rather than refusing; a lock taken on one thread is released from another (as at shutdown)."""
    import threading

    from rewardstack._service.namespaces import reserve

    held = StateLock(tmp_path, name=".create.lock").acquire()
    waiter = threading.Thread(target=reserve, args=(tmp_path, "alpha", 3))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not (tmp_path / "alpha").exists()  # waiting on the held lock
    releaser = threading.Thread(target=held.release)
    releaser.start()
    releaser.join()
    waiter.join(30)
    assert not waiter.is_alive() and (tmp_path / "alpha").is_dir() and not held.held
