"""The stack's weights are one figure everywhere: each loaded checkpoint counted once.

The stand-ins' diversity mask loads the same MPNet folder as relevance's second model. The card
record once counted it twice (307,677,996 bytes on the card against a start record of
216,816,940 on the standard stand-ins; issue 34). The chart's bands, the card record, the run's
start record, `/v1/stack` and `rewardstack plan` must give the same bytes, and say who shares.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rewardstack._service.batching import Lane
from rewardstack._settings import ServiceSettings

import pytest

from conftest import standin_config
from rewardstack._planning.plan import StackPlan, format_plan, plan_weights
from rewardstack.stack import RewardStack
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir, read_timeline
from rewardstack._telemetry.report import weight_bands

GIB = 1024**3


def _v1_stack(stack: RewardStack) -> dict:
    """What `GET /v1/stack` answers for this stack (the route's own function, over a ready worker)."""
    pytest.importorskip("fastapi")
    from rewardstack._service.app import describe

    namespaces = SimpleNamespace(loaded=lambda: [], on_disk=lambda: [])
    worker = SimpleNamespace(stack=stack, ready=True, draining=False, namespaces=namespaces, queue_length=lambda: 0,
                             queue_size=1, batch_requests=1, scored=0,
                             lane=Lane(ServiceSettings()))
    settings = SimpleNamespace(max_body_bytes=1, max_completions=1, max_chars=1, max_work_chars=1, deadline_s=1.0)
    return describe(worker, stack.config, settings)  # type: ignore[arg-type]


def test_card_start_record_service_and_plan_count_shared_weights_once(tiny_standins: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = standin_config(tiny_standins, tmp_path / "state")
    assert cfg.models["diversity_reward_model"].path == cfg.models["relevance_filter"].paths[1]  # shared on purpose
    stack = RewardStack(cfg, load_state=False)
    mon = Monitor.attach(stack, run_dir=RunDir(tmp_path / "run"))
    stack.score_step({"name": "augment", "prompt": "Say something.", "completions": ["One answer here.", "Another one."]},
                     save=False)
    mon.close()
    records = list(read_timeline(tmp_path / "run"))
    start = next(r for r in records if r["type"] == "start")["budget"]["weights_bytes"]
    card = next(r for r in records if r["type"] == "step")["card"]
    # The card record and the chart's bands (what plot_card stacks) hold the stack's weights once.
    assert card["weights_on_card"] == start
    bands = weight_bands([card])
    assert sum(v[0] for v in bands.values()) == start
    div = card["weights"]["diversity_reward_model"]
    assert div["shared_with"] == ["relevance_filter"] and div["counted_bytes"] == 0 and div["bytes"] > 0
    assert card["weights"]["relevance_filter"]["shared_with"] == ["diversity_reward_model"]
    # /v1/stack's placement: the same total, and who shares.
    placement = _v1_stack(stack)["placement"]
    assert placement["total_bytes"] == start and placement["device_bytes"] == start
    assert sum(m["counted_bytes"] for m in placement["models"].values()) == start
    assert placement["models"]["diversity_reward_model"]["shared_with"] == ["relevance_filter"]
    # `rewardstack plan` on the same config: the same bytes, and the shared checkpoint said so.
    models = plan_weights(cfg)  # plan_stack's weights, without its simulated passes
    assert sum(p.weights_bytes for p in models) == start
    diversity = next(p for p in models if p.name == "diversity_reward_model")
    assert diversity.weights_bytes == 0 and diversity.shares == "relevance_filter[1]"
    table = format_plan(StackPlan(40 * GIB, 36 * GIB, start, None, 30 * GIB, 0.9, "fits", 0, models))
    row = next(line for line in table.splitlines() if line.startswith("diversity_reward_model"))
    assert row.split()[2] == "shared" and "relevance_filter[1]" in table.split(row)[1]
