"""Config loading: defaults, layout, and one clear error naming the key for every bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewardstack.config import ALL_MODELS, default_config, from_dict, load_config
from rewardstack.errors import ConfigError

PACKAGED = Path(__file__).resolve().parents[1] / "src" / "rewardstack" / "configs"


def test_default_stack_is_openvalidators() -> None:
    cfg = default_config()
    assert set(cfg.models) == set(ALL_MODELS)
    assert cfg.reward_weights() == {
        "dpo_reward_model": 0.3, "rlhf_reward_model": 0.4, "reciprocate_reward_model": 0.3,
        "dahoas_reward_model": 0.0, "prompt_reward_model": 0.0,
    }
    active = [m.name for m in cfg.active_models()]
    assert "dahoas_reward_model" not in active and "prompt_reward_model" not in active
    assert cfg.models["relevance_filter"].paths == ["bert-base-uncased", "sentence-transformers/all-mpnet-base-v2"]


def test_packaged_configs_load() -> None:
    d = load_config(PACKAGED / "default.toml")
    assert d.device == "cuda:0" and d.models["reciprocate_reward_model"].revision == "501f895"
    assert d.models["dpo_reward_model"].dtype == "float16"
    o = load_config(PACKAGED / "offline.toml")
    assert o.device == "cpu"


def test_issue_layout_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "mydpo").mkdir()
    (tmp_path / "c.toml").write_text(
        'device = "cpu"\nstate_dir = "st"\n'
        '[models.dpo_reward_model]\npath = "mydpo"\nweight = 0.3\ndtype = "float16"\n'
        '[models.nsfw_filter]\nenabled = false\n'
        '[models.relevance_filter]\npaths = ["a/b", "c/d"]\nenabled = true\n'
    )
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.models["dpo_reward_model"].path == str(tmp_path / "mydpo")  # local folder resolved
    assert cfg.models["relevance_filter"].paths == ["a/b", "c/d"]  # hub ids kept
    assert cfg.state_dir == str(tmp_path / "st")
    assert not cfg.models["nsfw_filter"].active


def _err(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    return e.value


def test_weights_must_sum_to_one() -> None:
    e = _err({"models": {"dpo_reward_model": {"weight": 0.5}}})
    assert e.key == "models.*.weight" and "sum to 1" in str(e) and "dpo_reward_model=0.5" in str(e)


def test_weight_zero_turns_off_and_rebalanced_stack_is_valid() -> None:
    cfg = from_dict({"models": {"dpo_reward_model": {"weight": 0}, "rlhf_reward_model": {"weight": 0.7}}})
    assert not cfg.models["dpo_reward_model"].active


@pytest.mark.parametrize(
    "data, key",
    [
        ({"models": {"gpt5_reward_model": {}}}, "models.gpt5_reward_model"),
        ({"devices": "cpu"}, "devices"),
        ({"models": {"nsfw_filter": {"path": ""}}}, "models.nsfw_filter.path"),
        ({"models": {"nsfw_filter": {"weight": 0.1}}}, "models.nsfw_filter.weight"),
        ({"models": {"rlhf_reward_model": {"weight": -1}}}, "models.rlhf_reward_model.weight"),
        ({"models": {"rlhf_reward_model": {"weight": "0.4"}}}, "models.rlhf_reward_model.weight"),
        ({"models": {"rlhf_reward_model": {"dtype": "float64"}}}, "models.rlhf_reward_model.dtype"),
        ({"models": {"nsfw_filter": {"enabled": "yes"}}}, "models.nsfw_filter.enabled"),
        ({"models": {"relevance_filter": {"paths": ["only-one"]}}}, "models.relevance_filter.paths"),
        ({"models": {"dpo_reward_model": {"max_length": 0}}}, "models.dpo_reward_model.max_length"),
        ({"memory_budget": -5}, "memory_budget"),
        ({"gpu_utilization": 1.5}, "gpu_utilization"),
        ({"device": 0}, "device"),
        ({"models": {"nsfw_filter": {"paths": ["a", "b"]}}}, "models.nsfw_filter.paths"),
        ({"models": {"relevance_filter": {"path": "a"}}}, "models.relevance_filter.path"),
    ],
)
def test_bad_values_name_the_key(data: dict, key: str) -> None:
    e = _err(data)
    assert e.key == key and key in str(e)


def test_settings_tables_name_the_key_and_take_sizes() -> None:
    e = _err({"service": {"prot": 8000}})  # a misspelt key: named, with the closest one and all of them
    assert e.key == "service.prot" and "did you mean 'port'" in str(e) and "queue_size" in str(e)
    for data, key, problem in [({"service": {"port": "8000"}}, "service.port", "must be an integer, got '8000'"),
                               ({"service": {"queue_size": 0}}, "service.queue_size", "must be positive, got 0"),
                               ({"service": {"deadline_s": True}}, "service.deadline_s", "must be a number, got True"),
                               ({"memory": {"device_memory": "40 parsecs"}}, "memory.device_memory", "such as '40GiB'"),
                               ({"telemetry": {"leak_window": 1}}, "telemetry.leak_window", "must be at least 2"),
                               ({"input": 3}, "input", "must be a table")]:
        e = _err(data)
        assert e.key == key and problem in str(e), e
    cfg = from_dict({"memory": {"device_memory": "40GiB"}, "service": {"max_body_bytes": "1.5 MB", "deadline_s": 5}})
    assert (cfg.memory.device_memory, cfg.service.max_body_bytes, cfg.service.deadline_s) == (40 * 1024**3, 1_500_000, 5.0)


def test_missing_path_names_the_key() -> None:
    # An active model whose path was removed (set to nothing via an empty paths list for relevance).
    e = _err({"models": {"relevance_filter": {"paths": []}}})
    assert e.key.startswith("models.relevance_filter")


def test_bad_toml_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("device = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
