"""Strict model tables: unknown keys are errors naming the closest valid key; options are declared.

Also: the declared defaults are the scorers' own (read from their source), every option a scorer
reads is declared, and `rewardstack config --explain` lists every key.
"""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, fields
from importlib import resources
from pathlib import Path

import pytest

from rewardstack import cli, modeloptions, models
from rewardstack.config import ALL_MODELS, from_dict
from rewardstack.errors import ConfigError
from rewardstack.settings import TABLES

SCORERS = Path(modeloptions.__file__).parent / "scorers"
# Which models read options in which scorer module: the model registry's families.
MODULE_MODELS: dict[str, list[str]] = {}
for _m in models.MODELS:
    if not _m.is_rule:
        MODULE_MODELS.setdefault(f"{_m.family}.py", []).append(_m.name)


def _model(name: str, **keys: object):  # noqa: ANN202
    return from_dict({"models": {name: keys}}).models[name]


@pytest.mark.parametrize(("key", "closest"), [("wieght", "weight"), ("dtpye", "dtype"), ("logits_chunck", "logits_chunk"),
                                               ("trust_remote", "trust_remote_code")])
def test_unknown_key_names_itself_and_the_closest(key: str, closest: str) -> None:
    with pytest.raises(ConfigError) as err:
        _model("dpo_reward_model", **{key: 1})
    msg = str(err.value)
    assert f"models.dpo_reward_model.{key}" in msg and f"did you mean '{closest}'" in msg


def test_an_option_of_another_model_is_unknown() -> None:
    with pytest.raises(ConfigError, match=r"models\.dpo_reward_model\.kv_cache"):
        _model("dpo_reward_model", kv_cache=False)  # the judge's option
    with pytest.raises(ConfigError, match=r"models\.blacklist_filter\.max_batch"):
        _model("blacklist_filter", max_batch=4)


def test_options_are_typed_and_kept_only_when_set() -> None:
    assert _model("dpo_reward_model", logits_chunk=64, shared_prefix=False).options == {"logits_chunk": 64, "shared_prefix": False}
    assert _model("dpo_reward_model").options == {}
    assert _model("prompt_reward_model", options={"kv_cache": False}).options == {"kv_cache": False}
    for bad in ({"shared_prefix": "yes"}, {"logits_chunk": 0}, {"logits_chunk": 1.5}, {"options": {"max_batch": "4"}}):
        with pytest.raises(ConfigError, match=r"models\.dpo_reward_model\."):
            _model("dpo_reward_model", **bad)
    with pytest.raises(ConfigError, match=r"models\.relevance_filter\.bounds"):
        _model("relevance_filter", bounds=[0.1])
    with pytest.raises(ConfigError, match=r"models\.dpo_reward_model\.trust_remote_code"):
        _model("dpo_reward_model", trust_remote_code="yes")


def test_remote_code_defaults_belong_to_the_default_checkpoint() -> None:
    cfg = from_dict({})
    assert [n for n in ALL_MODELS if cfg.models[n].trust_remote_code] == ["dpo_reward_model"]
    assert _model("dpo_reward_model", path="my/gpt2").trust_remote_code is False
    assert _model("reciprocate_reward_model", path="someone/else").revision is None
    assert _model("reciprocate_reward_model").revision == "501f895"
    text = resources.files("rewardstack").joinpath("configs/default.toml").read_text()
    import tomllib

    data = tomllib.loads(text)
    assert data["models"]["dpo_reward_model"]["trust_remote_code"] is True
    assert not any(m.get("trust_remote_code") for n, m in data["models"].items() if n != "dpo_reward_model")


def _reads(module: str) -> dict[str, ast.expr | None]:
    """Option key -> default expression of every `cfg.options.get(key[, default])` / `opts.get` in a module."""
    tree = ast.parse((SCORERS / module).read_text())
    out: dict[str, ast.expr | None] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and re.search(r"(options|opts)$", ast.unparse(node.func.value))
                and node.args and isinstance(node.args[0], ast.Constant) and "runtime" not in ast.unparse(node.func.value)):
            out[node.args[0].value] = node.args[1] if len(node.args) > 1 else None
    return out


@pytest.mark.parametrize("module", sorted(MODULE_MODELS))
def test_every_option_a_scorer_reads_is_declared_with_its_default(module: str) -> None:
    reads = _reads(module)
    assert reads, module
    for key, default in reads.items():
        owners = [m for m in MODULE_MODELS[module] if key in models.option_keys(m)]
        assert owners, f"{module} reads option {key!r}, which no model of it declares"
        for m in owners:
            f = {f.name: f for f in fields(models.spec(m).options)}[key]
            declared = f.default if f.default is not MISSING else f.default_factory()
            if isinstance(default, ast.Constant):
                assert declared == default.value, (m, key)
            elif isinstance(default, ast.Attribute) or (isinstance(default, ast.Call) and key != "bounds"):
                # Computed at load (the model's bound, a device default): declared as unset.
                assert declared is None, (m, key, ast.unparse(default))


def test_declared_defaults_match_named_constants() -> None:
    from rewardstack.scorers.dahoas import BASE_CONFIG
    from rewardstack.scorers.embedding import RELEVANCE_BOUNDS

    assert modeloptions.DahoasOptions().base_config == BASE_CONFIG
    assert modeloptions.RelevanceOptions().bounds == list(RELEVANCE_BOUNDS)


def test_explain_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["config", "--explain"]) == 0
    out = capsys.readouterr().out
    for name in ALL_MODELS:
        assert f"[models.{name}]" in out
        for key in models.option_keys(name):
            assert re.search(rf"^  {key}\s", out, re.M), (name, key)
    for table, cls in TABLES.items():
        assert f"[{table}]:" in out
        for f in fields(cls):
            assert re.search(rf"^  {f.name}\s", out, re.M), (table, f.name)
    for key in ("device", "state_dir", "memory_budget", "path", "weight", "trust_remote_code", "revision"):
        assert re.search(rf"^  {key}\s", out, re.M), key
    assert "locked" not in re.findall(r"^  (\w+)", out, re.M)  # internal, not a key


def test_config_check_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[models.dpo_reward_model]\nweight = 1.0\n[models.rlhf_reward_model]\nweight = 0\n'
                    '[models.reciprocate_reward_model]\nweight = 0\n')
    assert cli.main(["config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "refused until `rewardstack download`" in out
    path.write_text('[models.dpo_reward_model]\nwieght = 1.0\n')
    assert cli.main(["config", "--config", str(path)]) == 1
    assert "did you mean 'weight'" in capsys.readouterr().err
