"""`bench.burst` runs: a small burst on `rewardstack serve --reward-model DIR` is drained whole and
its row printed; a row whose server is not here (OpenRLHF's serve_rm.py before `bench.peer` is
merged) is reported as not run, not as a failure. Figures mean nothing here."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_fixtures import make_tiny_llama_rm

pytest.importorskip("aiohttp")
pytest.importorskip("psutil")


def test_a_small_burst_on_rewardstack_serve(tmp_path: Path) -> None:
    from bench import burst

    model = make_tiny_llama_rm(tmp_path / "tiny-rm")
    results = {"serve": burst.run_row("serve", model, burst.queries(32), tmp_path, "cpu"),
               "serve_rm": {"skipped": "bench.peer is not here"}}
    assert [r is not None for r in results["serve"]["rewards"]] == [True] * 32
    lines = burst.table(results, 32)
    row = next(line for line in lines if line.startswith("serve "))
    drain, rate, rss, refused, errors, lost, diff = row.split()[1:]
    assert (refused, errors, lost, diff) == ("0", "0", "0", "0.0e+00") and float(rss) > 50
    assert any(line.startswith("serve_rm") and "not run: bench.peer" in line for line in lines)
