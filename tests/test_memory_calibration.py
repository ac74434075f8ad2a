"""Calibrating what runs: profiles take the scoring path (prefix cache included) up to the admitted
shape, the planner admits nothing past the profiled shapes, and fits are cached beside the config.

The deep stand-in (24 layers, narrow) makes the keys and values the suffix pass keeps for every
layer the largest term, as on GPT-J or BTLM at full size; a profile without the prefix cache (what
the scorers did before) misses it, and the strict expected failure below shows the check notices.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import make_runtime
from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager, Profile
from rewardstack import _paths as paths
from rewardstack._memory.calibration import CalibrationCache, cache_path_for
from rewardstack._memory.costmodel import CostModel, plan_batches, profile_shapes
from rewardstack._scorers.prefix import PrefixRunner, split_prefix
from rewardstack._scorers.reciprocate import TEMPLATE, ReciprocateScorer
from rewardstack._standins.tokenizer import DECODER_INPUTS, save_tokenizer

MAX_LEN = 384


@pytest.fixture(scope="module")
def deep_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 24-layer, 32-wide GPT-J reward classifier: the per-layer K/V dominates its activations."""
    from transformers import GPTJConfig, GPTJForSequenceClassification

    folder = tmp_path_factory.mktemp("deep") / "deep_gptj"
    folder.mkdir()
    tok = save_tokenizer(folder, MAX_LEN, input_names=DECODER_INPUTS)
    config = GPTJConfig(vocab_size=len(tok), n_positions=MAX_LEN, n_embd=32, n_layer=24, n_head=2, rotary_dim=8,
                        n_inner=64, num_labels=1, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                        eos_token_id=tok.sep_token_id)
    torch.manual_seed(7)
    GPTJForSequenceClassification(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def deep(deep_folder: Path) -> ReciprocateScorer:
    """The Reciprocate scorer on the deep stand-in, profiled up to its 384-token bound."""
    cfg = ModelConfig(name="reciprocate_reward_model", path=str(deep_folder), weight=1.0, max_length=MAX_LEN, batch_size=4)
    return ReciprocateScorer(cfg, make_runtime())


def _underfit(scorer: ReciprocateScorer) -> CostModel:
    """The old calibration: the same shapes run whole, without the prefix cache (use_cache=False)."""
    mm = scorer.runtime.memory

    def whole(b: int, length: int) -> None:
        ids = [[5 + (7 * r + 3 * j) % 900 for j in range(length)] for r in range(b)]
        scorer._forward(PrefixRunner(scorer.body, [], pad_id=scorer.fill_id), ids, [length - 1] * b)

    return mm.calibrate(Profile("underfit", whole, max_length=MAX_LEN, max_batch=4))


def _measured_vs_predicted(scorer: ReciprocateScorer, cost: CostModel) -> list[tuple[int, int, float, int]]:
    """(B, L, predicted, measured) for batches off the profile grid that share a long prompt."""
    mm = scorer.runtime.memory
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    prompt = " ".join(rng.choice(words) for _ in range(150))
    grid = {(b, l) for b, l, _ in cost.samples}
    rows = []
    for b, extra in [(1, 150), (2, 60), (3, 20), (2, 140), (4, 30), (3, 90)]:
        comps = [" ".join(rng.choice(words) for _ in range(extra + 9 * k)) for k in range(b)]
        texts = [TEMPLATE.format(prompt=prompt, completion=c) for c in comps]
        ids = [x[:MAX_LEN] for x in scorer.tokenizer(texts).input_ids]
        prefix, _ = split_prefix(ids, True)
        pos = [len(x) - 1 for x in ids]
        prefix = prefix[: min(pos + [len(prefix)])]
        assert len(prefix) > 100, "the batches share a long prompt"
        runner = PrefixRunner(scorer.body, prefix, pad_id=scorer.fill_id)
        length = max(len(x) for x in ids)
        assert (b, length) not in grid
        with torch.inference_mode(), mm.tracker:
            runner.state()  # live before the batch is planned, as `MemoryManager.run(prepare=)` does
            measured = mm.measure(lambda: scorer._forward(runner, ids, pos), "check")
        rows.append((b, length, cost.predict(b, length), measured))
    return rows


def test_profile_with_the_prefix_cache_bounds_unseen_shapes(deep: ReciprocateScorer) -> None:
    scorer = deep
    mm = scorer.runtime.memory
    cost = mm.cost_models[scorer.name]
    assert cost.extents()[1] == MAX_LEN  # profiled up to the longest input it admits
    for b, length, predicted, measured in _measured_vs_predicted(scorer, cost):
        assert measured <= predicted / mm.margin, (b, length, predicted, measured, cost.describe())


@pytest.mark.xfail(strict=True, reason="a profile without the prefix cache misses the per-layer K/V term")
def test_profile_without_the_prefix_cache_underestimates(deep: ReciprocateScorer) -> None:
    scorer = deep
    mm = scorer.runtime.memory
    cost = _underfit(scorer)
    for b, length, predicted, measured in _measured_vs_predicted(scorer, cost):
        assert measured <= predicted / mm.margin, (b, length, predicted, measured, cost.describe())


def _small_stack_config(standins: Path, folder: Path) -> Path:
    """A config file (in `folder`) for one stand-in reward model with every mask off."""
    rlhf = (standins / "rlhf_reward_model").resolve()
    text = (f'device = "cpu"\nstate_dir = "state"\n\n[models.rlhf_reward_model]\npath = "{rlhf}"\nweight = 1.0\n'
            "\n[models.dpo_reward_model]\nweight = 0.0\n\n[models.reciprocate_reward_model]\nweight = 0.0\n")
    for mask in ("blacklist_filter", "task_validator_filter", "relevance_filter", "diversity_reward_model", "nsfw_filter"):
        text += f"\n[models.{mask}]\nenabled = false\n"
    path = folder / "stack.toml"
    path.write_text(text)
    return path


def test_a_restart_reads_saved_cost_models_and_does_not_profile(standins, tmp_path: Path,  # noqa: ANN001
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardstack import RewardStack

    # An empty home: the session's shared cache may already hold this checkpoint's fit.
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    (tmp_path / "cfg").mkdir()
    path = _small_stack_config(standins, tmp_path / "cfg")
    first = RewardStack.from_config(str(path), load_state=False)
    assert first.memory.profiled == ["rlhf_reward_model"]
    cache = cache_path_for(path)
    # The home's one cache (the suite's temporary $REWARDSTACK_HOME), shared by every config.
    assert cache is not None and cache.exists() and cache == paths.calibration_file()
    assert cache.is_relative_to(paths.home()) and not cache.is_relative_to(tmp_path / "cfg")
    assert not (Path(first.config.state_dir) / cache.name).exists()  # not in the scoring state
    second = RewardStack.from_config(str(path), load_state=False)
    assert second.memory.profiled == [] and second.memory.calibration.hits == 1
    a, b = first.memory.cost_models["rlhf_reward_model"], second.memory.cost_models["rlhf_reward_model"]
    assert a.to_dict() == b.to_dict()
    # --recalibrate profiles again; a changed key (another max_length) does too.
    again = RewardStack.from_config(str(path), load_state=False, recalibrate=True)
    assert again.memory.profiled == ["rlhf_reward_model"]
    path.write_text(path.read_text().replace("weight = 1.0\n", "weight = 1.0\nmax_length = 256\n", 1))
    changed = RewardStack.from_config(str(path), load_state=False)
    assert changed.memory.profiled == ["rlhf_reward_model"]
    assert len(json.loads(cache.read_text())["entries"]) == 2


def test_calibration_key_covers_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rewardstack._memory.calibration as calibration_mod  # where the calibration key is built

    calls = []
    run = lambda b, l: calls.append((b, l)) or torch.ones(b, l, 8).sum()  # noqa: E731
    model = ModelConfig(name="m", path="x", weight=1.0)
    for torch_version, want_profile in [("2.13.0", True), ("2.13.0", False), ("2.14.0", True)]:
        monkeypatch.setattr(calibration_mod, "environment", lambda d, v=torch_version: {"device": "cpu", "torch": v, "transformers": "5"})
        mm = MemoryManager(None, calibration=CalibrationCache(tmp_path / "c.json"))
        mm.describe_model(model)
        mm.calibrate(Profile("m", run, max_length=64, max_batch=2))
        assert (mm.profiled == ["m"]) == want_profile, torch_version


def test_a_damaged_cache_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{not json")
    cache = CalibrationCache(tmp_path / "c.json")
    assert cache.get("k") is None
    cache.put("k", {"cost": {}})
    entries = json.loads((tmp_path / "c.json").read_text())["entries"]
    assert set(entries) == {"k"} and entries["k"]["cost"] == {}


def test_the_planner_admits_only_profiled_shapes() -> None:
    cost = CostModel(a=0, b=1.0).fit([(b, l, 100 * b * l) for b, l in profile_shapes(256, 4, max_tokens=256)])
    assert cost.extents() == (4, 256, 256)
    assert cost.admits(1, 256) and cost.admits(4, 64) and not cost.admits(2, 200) and not cost.admits(1, 257)
    lengths = [60] * 10 + [250, 256]
    batches = plan_batches(lengths, cost, 1e12)  # an unlimited budget: only the profile limits
    assert all(cost.admits(len(b), max(lengths[i] for i in b)) for b in batches)
    mm = MemoryManager(10**12)
    mm.set_cost_model("m", cost)
    assert mm.length_cap("m", 4096) == 256  # never longer than measured


def test_trust_recovers_after_clean_batches() -> None:
    cost = CostModel(b=1.0)
    cost.distrust()
    cost.distrust()
    low = cost.trust
    assert low < 1
    for _ in range(19):
        assert not cost.record_clean()
    assert cost.record_clean() and cost.trust > low
    for _ in range(20):
        cost.record_clean()
    assert cost.trust == pytest.approx(1.0)


def test_tuning_runs_on_the_simulated_device_it_tunes_for() -> None:
    """A tuned setting (DPO's logits chunk) is timed as the passes will run: on the simulated device
    every op also pays the tracker's dispatch, so an untracked timing favours many small ops (it
    picked 32-row chunks on the tiny soak stack, 12,700 ops a step, where tracked timing picks 128)."""
    mm = MemoryManager(1 << 30)
    assert mm.tracker is not None
    seen: list[tuple[bool, int]] = []

    def tune() -> dict[str, int]:
        with mm.tracker.watch("tune") as w:
            x = torch.ones(1024) * 2  # two 4 KiB storages live at once (the ones, the product) if the tracker counts
        seen.append((mm.tracker.is_active(), w.peak_increase))
        del x
        return {"chunk": 16}

    got: list[dict] = []
    mm.calibrate(Profile("tuned", lambda b, n: torch.ones(b, n) * 2, max_length=8, max_batch=2, tune=tune, apply=got.append))
    assert seen == [(True, 8192)]
    assert got == [{"chunk": 16}]
    assert mm.tracker.budget_bytes == 1 << 30  # lifted for the timing passes only


def test_a_setting_timed_on_a_busy_machine_is_timed_again_at_a_quiet_start(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting chosen by timing while the timing thread ran 40% of the wall time (another process
    on every core) is not trusted: the entry says so, a start on the still busy machine uses it, and
    the first quiet start times and profiles again (before, it was kept until `--recalibrate`)."""
    import time

    import rewardstack._memory.calibration as calibration_mod

    model = ModelConfig(name="m", path="x", weight=1.0)
    timed: list[float] = []

    def start(share: float, measured: int) -> tuple[list[str], list[dict]]:
        monkeypatch.setattr(calibration_mod, "cpu_clock", lambda: share * time.perf_counter(), raising=False)
        mm = MemoryManager(None, calibration=CalibrationCache(tmp_path / "c.json"))
        mm.describe_model(model)
        got: list[dict] = []
        tune = lambda: timed.append(share) or {"chunk": measured}  # noqa: E731
        mm.calibrate(Profile("m", lambda b, n: torch.ones(b, n) * 2, max_length=16, max_batch=2, tune=tune,
                             apply=got.append))
        return mm.profiled, got

    assert start(0.4, 32) == (["m"], [{"chunk": 32}])
    assert start(0.4, 64) == ([], [{"chunk": 32}])  # busy still: the entry serves
    assert start(1.0, 128) == (["m"], [{"chunk": 128}])  # quiet: timed again
    assert start(1.0, 256) == ([], [{"chunk": 128}])  # timed quiet: kept
    assert timed == [0.4, 1.0]


def test_a_busy_timing_keeps_the_planned_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded measurement can only err toward the plan: timed busy, the profile's `planned`
    settings are applied, not what the timing chose; timed quiet, the timing's."""
    import time

    import rewardstack._memory.calibration as calibration_mod

    for share, want in [(0.4, {"pass_tokens": 4096}), (0.95, {"pass_tokens": 1024})]:
        monkeypatch.setattr(calibration_mod, "cpu_clock", lambda s=share: s * time.perf_counter())
        got: list[dict] = []
        MemoryManager(None).calibrate(Profile("m", lambda b, n: torch.ones(b, n) * 2, max_length=16, max_batch=2,
                                              tune=lambda: {"pass_tokens": 1024}, apply=got.append,
                                              planned={"pass_tokens": 4096}))
        assert got == [want], share
