"""Strict model tables: unknown keys are errors naming the closest valid key; options are declared.

Also: each option's default is written once (nothing reads an option with a fallback of its own),
every option a scorer reads is declared and every declared one is read, and `rewardstack config
--explain` lists every key.
"""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

from rewardstack import cli, _modeloptions as modeloptions, _models as models
from rewardstack.config import ALL_MODELS, ModelConfig, from_dict
from rewardstack.errors import ConfigError
from rewardstack._settings import TABLES

PACKAGE = Path(modeloptions.__file__).parent
SCORERS = PACKAGE / "_scorers"
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


def test_options_are_typed_with_every_default() -> None:
    assert _model("dpo_reward_model", logits_chunk=64, shared_prefix=False).options == modeloptions.DpoOptions(
        logits_chunk=64, shared_prefix=False)
    assert _model("dpo_reward_model").options == modeloptions.DpoOptions()
    assert _model("prompt_reward_model", options={"kv_cache": False}).options == modeloptions.JudgeOptions(kv_cache=False)
    assert _model("blacklist_filter").options == modeloptions.NoOptions()
    # Configured in code, a dict of the keys to set is checked as a table is.
    assert ModelConfig(name="dpo_reward_model", options={"max_batch": 4}).options == modeloptions.DpoOptions(max_batch=4)
    with pytest.raises(ConfigError, match=r"models\.dpo_reward_model\.max_batch"):
        ModelConfig(name="dpo_reward_model", options={"max_batch": 0})
    with pytest.raises(TypeError, match="DpoOptions"):
        ModelConfig(name="dpo_reward_model", options=modeloptions.JudgeOptions())
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


def _option_reads(path: Path) -> tuple[set[str], list[str]]:
    """Keys a module reads as `<...>options.<key>` or `opts.<key>`, and every read with a fallback
    of its own (`options.get(key, default)`, `getattr(options, key, default)`)."""
    tree = ast.parse(path.read_text())
    keys: set[str] = set()
    fallbacks: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and re.search(r"(\boptions|\bopts)$", ast.unparse(node.value)) \
                and "runtime" not in ast.unparse(node.value):
            if node.attr == "get":
                fallbacks.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            else:
                keys.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) == 3 and re.search(r"options$", ast.unparse(node.args[0])):
            keys.add(ast.literal_eval(node.args[1]))
    return keys, fallbacks


def test_no_option_default_is_written_twice() -> None:
    """Each default is declared once (`modeloptions`): nothing in the package reads an option with
    a fallback of its own, which would be a second copy of the default."""
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _option_reads(path)[1]]
    assert not found, found


@pytest.mark.parametrize("module", sorted(MODULE_MODELS))
def test_every_option_a_scorer_reads_is_declared(module: str) -> None:
    reads, _ = _option_reads(SCORERS / module)
    assert reads, module
    for key in reads:
        assert any(key in models.option_keys(m) for m in MODULE_MODELS[module]), \
            f"{module} reads option {key!r}, which no model of it declares"


def test_every_declared_option_is_read() -> None:
    reads = set().union(*(_option_reads(path)[0] for path in PACKAGE.rglob("*.py")))
    for m in models.MODELS:
        assert models.option_keys(m.name) <= reads, (m.name, models.option_keys(m.name) - reads)


def test_declared_defaults_are_the_references() -> None:
    """The spec's own numbers, written once, as the options' defaults."""
    assert modeloptions.DahoasOptions().base_config == "EleutherAI/gpt-j-6b"
    assert modeloptions.RelevanceOptions().bounds == [-0.0246, 0.3]


def test_explain_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["config", "--explain"]) == 0
    out = capsys.readouterr().out
    for name in ALL_MODELS:
        assert f"[models.{name}]" in out
        for key in models.option_keys(name):
            assert re.search(rf"^  {key}\s", out, re.M), (name, key)
    for table, cls in TABLES.items():
        assert f"[{table}]:" in out
        for key in cls.model_fields:
            assert re.search(rf"^  {key}\s", out, re.M), (table, key)
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
