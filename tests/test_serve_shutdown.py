"""`rewardstack serve` says in one line that it stopped, and how (issue 34 #8: it logged nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from service_fixtures import Server, write_config  # noqa: E402


def test_a_drained_shutdown_is_one_line(tiny_standins: Path, tmp_path: Path) -> None:
    config = write_config(tiny_standins, tmp_path / "state", f"shutdown-{tmp_path.name}")
    server = Server(config, log=tmp_path / "server.log").start()
    try:
        server.wait_ready()
    finally:
        rc = server.terminate()
    log = (tmp_path / "server.log").read_text()
    lines = [ln for ln in log.splitlines() if "stopped" in ln]
    assert rc == 0 and len(lines) == 1, log[-3000:]
    assert lines[0].startswith("rewardstack serve: stopped") and "SIGTERM" in lines[0] and "0 steps scored" in lines[0]
