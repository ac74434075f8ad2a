"""Tests of `rewardstack plan`: verdicts from the configs alone, the budget and placement the stack
would use, and the planned batch checked against a fresh simulation (so an under-fitted cost model fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewardstack.cli import main
from rewardstack.config import load_config
from rewardstack._memory.budget import ACTIVATION_SHARE
from rewardstack._planning.plan import VERDICTS, plan_stack
from rewardstack._planning import simulate as S

GIB = 1024**3


def _tiny_stack(tmp: Path, *, dpo_layers: int = 2, dpo_len: int = 1024) -> Path:
    """A stack of tiny local checkpoints (config.json only: the plan reads nothing else)."""
    def folder(name: str, conf: dict) -> str:
        (tmp / name).mkdir(parents=True, exist_ok=True)
        (tmp / name / "config.json").write_text(json.dumps(conf))
        return name
    enc = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 128, "max_position_embeddings": 512}
    dpo = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": dpo_layers, "num_attention_heads": 4, "max_position_embeddings": dpo_len}
    deb = {"model_type": "deberta-v2", "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 128, "relative_attention": True, "position_buckets": 256, "pos_att_type": ["p2c", "c2p"],
           "position_biased_input": False, "type_vocab_size": 0, "num_labels": 1}
    rob = {"model_type": "roberta", "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 128, "max_position_embeddings": 514, "num_labels": 2}
    text = f'''
device = "cpu"
[models.dpo_reward_model]
path = "{folder('dpo', dpo)}"
weight = 0.5
[models.rlhf_reward_model]
path = "{folder('oa', deb)}"
weight = 0.5
[models.reciprocate_reward_model]
weight = 0.0
[models.relevance_filter]
paths = ["{folder('bert', enc)}", "{folder('mpnet', enc)}"]
[models.diversity_reward_model]
path = "mpnet"
[models.nsfw_filter]
path = "{folder('nsfw', rob)}"
'''
    (tmp / "stack.toml").write_text(text)
    return tmp / "stack.toml"


def test_verdicts_follow_the_card(tmp_path: Path) -> None:
    cfg = load_config(_tiny_stack(tmp_path))
    big = plan_stack(cfg, 4 * GIB)
    assert big.verdict == "fits" and all(p.where == "resident" for p in big.models)
    assert big.swap_bytes_per_step == 0
    # Weights of shared checkpoints are counted once (diversity shares relevance's model 2).
    by = {p.name: p for p in big.models}
    assert by["diversity_reward_model"].weights_bytes == 0 and by["relevance_filter[1]"].weights_bytes > 0
    # A card whose weight budget cannot hold every model: swapping, with its traffic per step.
    # The card whose weight share (usable x (1 - ACTIVATION_SHARE)) is 90% of the weights: every
    # model still fits the weight budget alone, so some swap in and out each step.
    w = big.weights_bytes
    share = 1 - ACTIVATION_SHARE
    usable = int(0.9 * w / share)
    small_card = int((usable + cfg.headroom_bytes) / cfg.gpu_utilization) + 1
    cfg.memory_budget = 1 * GIB  # activations as they would be on a real card: the weights decide
    tight = plan_stack(cfg, small_card)
    assert tight.usable_bytes == int(small_card * cfg.gpu_utilization) - cfg.headroom_bytes
    assert tight.weights_budget == int(tight.usable_bytes * share) and tight.weights_budget < w
    assert tight.verdict == "fits with swapping", [(p.name, p.where, p.input_fits) for p in tight.models]
    swapped = [p for p in tight.models if p.where != "resident"]
    assert swapped and tight.swap_bytes_per_step >= min(p.weights_bytes for p in swapped if p.weights_bytes)


def test_cannot_fit_when_the_longest_input_needs_more_than_the_budget(tmp_path: Path) -> None:
    cfg = load_config(_tiny_stack(tmp_path, dpo_len=4096))
    cfg.memory_budget = 8 * 1024**2  # 8 MiB of activations
    plan = plan_stack(cfg, 4 * GIB)
    dpo = next(p for p in plan.models if p.name == "dpo_reward_model")
    assert not dpo.input_fits and plan.verdict == "cannot fit"
    # The longest input that does fit, by the simulation: inputs past it would be cut.
    assert dpo.longest_fitting < dpo.bound
    limit = plan.activation_budget * plan.margin
    if dpo.longest_fitting:
        fit = S.simulate_peak("dpo_reward_model", 1, dpo.longest_fitting, config=cfg, arch=S.load_arch(dpo.path), exact=False, padded=False)
        over = S.simulate_peak("dpo_reward_model", 1, dpo.longest_fitting + 1, config=cfg, arch=S.load_arch(dpo.path), exact=False, padded=False)
        assert fit.peak_bytes <= limit < over.peak_bytes


def test_planned_batch_fits_a_fresh_simulation(tmp_path: Path) -> None:
    """The largest batch the plan gives each model, simulated anew, stays within the budget:
    a cost model fitted too low would admit a batch that does not."""
    cfg = load_config(_tiny_stack(tmp_path))
    cfg.memory_budget = 64 * 1024**2
    plan = plan_stack(cfg, 4 * GIB)
    limit = plan.activation_budget * plan.margin
    for p in plan.models:
        if p.max_batch_at_bound == 0:
            continue
        sim = S.simulate_peak(p.name, p.max_batch_at_bound, p.bound, p.dtype, config=cfg, arch=S.load_arch(p.path), exact=False)
        assert sim.peak_bytes <= 1.05 * limit, (p.name, p.max_batch_at_bound, sim.peak_bytes, limit)


def test_cli_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = _tiny_stack(tmp_path)
    out = tmp_path / "plan.json"
    monkeypatch.setenv("REWARDSTACK_HOME", str(tmp_path / "home"))
    S._CACHE.clear()
    assert main(["plan", "--config", str(config), "--device-memory", "4GiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    # The simulated peaks were kept on disk, per architecture: a second run reads them, same plan.
    assert list((tmp_path / "home" / "plan-cache").glob("*.json"))
    S._CACHE.clear()
    assert main(["plan", "--config", str(config), "--device-memory", "4GiB", "--json", str(tmp_path / "again.json")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "again.json").read_text())["models"] == json.loads(out.read_text())["models"]
    S.use_disk_cache(None)
    data = json.loads(out.read_text())
    assert data["verdict"] in VERDICTS and f"verdict: {data['verdict']}" in text
    assert {m["name"] for m in data["models"]} <= set(S.SCORERS)
    for m in data["models"]:
        assert m["name"] in text


def test_default_stack_on_the_reports_card() -> None:
    """The shipped default stack, from the shipped architectures alone: weights and verdicts."""
    from rewardstack.config import default_config

    plan = plan_stack(default_config(), 80 * GIB)
    assert 18 * GIB < plan.weights_bytes < 20 * GIB
    assert plan.verdict == "fits" and all(p.where == "resident" for p in plan.models)
    by = {p.name: p for p in plan.models}
    assert by["rlhf_reward_model"].bound == 512 and by["dpo_reward_model"].bound == 8192
    # BTLM's ALiBi attention at 8,192 tokens in 512-row blocks: the largest allocation is one
    # block's [32, 512, 8192] float32 softmax (the model's own would hold [32, 8192, 8192], 8 GiB).
    assert by["dpo_reward_model"].attention == "blocked(512)"
    assert by["dpo_reward_model"].largest_alloc_bytes == 32 * 512 * 8192 * 4
    # The report's 40 GiB card: every model resident, no input cut below the reference's bound
    # (with the model's own attention, DPO inputs past 6,450 tokens were cut here).
    card = plan_stack(default_config(), 40 * GIB)
    assert card.verdict == "fits" and all(p.where == "resident" and p.input_fits for p in card.models)
    assert next(p for p in card.models if p.name == "dpo_reward_model").longest_fitting == 8192


def test_gpu_check_dry_run_plans_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/gpu_check.py's CPU parts: simulated peaks per shape, the workload's planned batches
    and the reference call's OOM length on a 40 GiB card."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parent.parent / "scripts" / "gpu_check.py")
    gc_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc_mod)  # type: ignore[union-attr]
    assert gc_mod.main(["--dry-run", "--models", "rlhf_reward_model,nsfw_filter", "--completions", "12"]) == 0
    out = capsys.readouterr().out
    assert "rlhf_reward_model B=1 L=512" in out and "nsfw_filter: 12 inputs" in out
    line = next(x for x in out.splitlines() if x.startswith("reference OpenAssistant call"))
    n = int(line.split("simulated OOM from ")[1].split()[0])
    # 40 GiB minus these two models' weights leaves ~37.9 GiB: DeBERTa's unbounded pass fills it
    # past 10,000 tokens (its 4.40 GiB tensor came at 8,587 on the report's fuller card).
    assert 9_000 < n < 12_000


def test_card_size_from_the_config_or_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _tiny_stack(tmp_path)
    assert main(["plan", "--config", str(config), "--no-cache"]) == 1
    assert "--device-memory" in capsys.readouterr().err
    config.write_text(config.read_text() + '\n[memory]\ndevice_memory = "4GiB"\n')
    assert main(["plan", "--config", str(config), "--no-cache"]) == 0
    assert "card 4.00 GiB" in capsys.readouterr().out


def test_table_separates_fits_from_the_longest_input_and_says_why(tmp_path: Path) -> None:
    from rewardstack._planning.plan import format_plan

    cfg = load_config(_tiny_stack(tmp_path, dpo_len=4096))
    cfg.memory_budget = 8 * 1024**2
    plan = plan_stack(cfg, 4 * GIB)
    dpo = next(p for p in plan.models if p.name == "dpo_reward_model")
    text = format_plan(plan)
    row = next(ln for ln in text.splitlines() if ln.startswith("dpo_reward_model "))
    cells = row.split()
    # fits "no", then the longest input that fits, as a separate column; no batch at the bound
    assert cells[7] == "no" and cells[8] == str(dpo.longest_fitting) and cells[9:11] == ["-", "-"]
    why = [ln for ln in text.splitlines() if ln.startswith("why: ")]
    assert len(why) == sum(1 for p in plan.models if not p.input_fits or p.where == "cpu")
    assert any(ln.startswith("why: dpo_reward_model: ") and f"longer than {dpo.longest_fitting} tokens" in ln for ln in why)
    assert all(c == "yes" for ln in text.splitlines() if ln.startswith("nsfw_filter ") for c in ln.split()[7:8])


def test_host_placed_models_show_as_host(tmp_path: Path) -> None:
    from dataclasses import replace

    from rewardstack._planning.plan import format_plan

    cfg = load_config(_tiny_stack(tmp_path))
    plan = plan_stack(cfg, 4 * GIB)
    nsfw = next(p for p in plan.models if p.name == "nsfw_filter")
    plan.models = [replace(p, where="cpu", reason="test: no room") if p is nsfw else p for p in plan.models]
    text = format_plan(plan)
    row = next(ln for ln in text.splitlines() if ln.startswith("nsfw_filter ")).split()
    assert row[3] == "cpu" and row[7] == "host" and row[8:11] == ["-", "-", "-"]
    assert any(ln.startswith("why: nsfw_filter: on the host (test: no room)") for ln in text.splitlines())


def _card_with_weight_budget(cfg, weights_budget: int) -> int:  # noqa: ANN001
    """The card size whose weight budget (usable x (1 - ACTIVATION_SHARE)) is `weights_budget`."""
    usable = int(weights_budget / (1 - ACTIVATION_SHARE))
    return int((usable + cfg.headroom_bytes) / cfg.gpu_utilization) + 1


def test_host_memory_line_counts_pinned_swap_copies_and_host_models(tmp_path: Path) -> None:
    """The plan's host line: swapped models' weights kept pinned on the host (a module a resident
    model shares stays on the card, so it is not pinned), each model's copies in slabs that torch's
    pinned allocator rounds up to a power of two; models placed on the host as pageable."""
    from rewardstack._planning.plan import format_plan

    def pinned(n: int) -> int:  # one slab under 1 GiB per model: rounded up to a power of two
        return 1 << (n - 1).bit_length()

    cfg = load_config(_tiny_stack(tmp_path))
    cfg.memory_budget = 1 * GIB
    big = plan_stack(cfg, 4 * GIB)
    assert (big.host_pinned_bytes, big.host_pageable_bytes) == (0, 0)
    w = {p.name: p.weights_bytes for p in big.models}
    # 90% of the weights: DPO and both relevance encoders swap; relevance's second encoder is the
    # checkpoint diversity loads, and diversity stays resident, so that module is never pinned.
    tight = plan_stack(cfg, _card_with_weight_budget(cfg, int(0.9 * big.weights_bytes)))
    where = {p.name: p.where for p in tight.models}
    assert where["dpo_reward_model"] == where["relevance_filter[1]"] == "swap" and where["diversity_reward_model"] == "resident"
    assert tight.host_pinned_bytes == pinned(w["dpo_reward_model"]) + pinned(w["relevance_filter[0]"]) == 72 * 1024**2
    assert tight.host_pageable_bytes == 0
    # A weight budget smaller than DPO: DPO is placed on the host (pageable), the rest swap or stay.
    host = plan_stack(cfg, _card_with_weight_budget(cfg, 30 * 1024**2))
    where = {p.name: p.where for p in host.models}
    assert where["dpo_reward_model"] == "cpu" and where["rlhf_reward_model"] == "swap"
    assert host.host_pageable_bytes == w["dpo_reward_model"]
    assert host.host_pinned_bytes == pinned(w["rlhf_reward_model"]) + pinned(w["relevance_filter[0]"])
    line = next(x for x in format_plan(host).splitlines() if x.startswith("host memory: "))
    assert line.startswith(f"host memory: {host.host_pinned_bytes / GIB:.2f} GiB pinned")
    assert f"{host.host_pageable_bytes / GIB:.2f} GiB pageable" in line
