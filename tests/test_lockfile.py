"""`rewardstack download` and the lock file, with the hub client replaced by a fake.

The fake's commits are made here from the repository names (sha1 of the name): the hub is not
reachable, and nothing in rewardstack makes a commit up. The locked BTLM-like stand-in is served by
the fake as the snapshot of a hub id, and loads through its remote code only once locked.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from importlib import resources
from pathlib import Path

import pytest

from causal_fixtures import make_runtime
from rewardstack import cli, _hub as hub
from rewardstack.config import default_config, load_config
from rewardstack.errors import ConfigError, ModelLoadError
from rewardstack._scorers import dpo
from rewardstack._scorers.base import ScoreRequest
from rewardstack._standins import make_btlm_checkpoint


def fake_commit(repo: str, revision: str | None) -> str:
    return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()


class FakeHub:
    """Resolves to sha1(name@revision); `fetch` copies `sources[repo]` (or writes a marker file)."""

    def __init__(self, root: Path, sources: dict[str, Path] | None = None, bad: dict[str, str] | None = None) -> None:
        self.root, self.sources, self.bad = root, sources or {}, bad or {}
        self.resolved: list[tuple[str, str | None]] = []
        self.fetched: list[tuple[str, str]] = []

    def resolve(self, repo_id: str, revision: str | None) -> str:
        self.resolved.append((repo_id, revision))
        return self.bad.get(repo_id, fake_commit(repo_id, revision))

    def _folder(self, repo_id: str, commit: str) -> Path:
        return self.root / repo_id.replace("/", "--") / commit

    def fetch(self, repo_id: str, commit: str) -> Path:
        self.fetched.append((repo_id, commit))
        folder = self._folder(repo_id, commit)
        if repo_id in self.sources:
            shutil.copytree(self.sources[repo_id], folder, dirs_exist_ok=True)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text("{}")
        return folder

    def snapshot(self, repo_id: str, commit: str) -> Path | None:
        folder = self._folder(repo_id, commit)
        return folder if folder.exists() else None


@pytest.fixture
def default_toml(tmp_path: Path) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(resources.files("rewardstack").joinpath("configs/default.toml").read_text(), encoding="utf-8")
    return path


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    client = FakeHub(tmp_path / "hubcache")
    monkeypatch.setattr(hub, "default_client", lambda: client)
    return client


def test_download_locks_every_hub_id_of_the_active_models(default_toml: Path, fake: FakeHub,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["download", "--config", str(default_toml)]) == 0
    lock = json.loads((default_toml.parent / "stack.lock.json").read_text())
    assert lock["version"] == 1 and lock["config"] == "stack.toml"
    got = {(e["model"], e["hub_id"]): e for e in lock["models"]}
    assert set(got) == {
        ("dpo_reward_model", "cerebras/btlm-3b-8k-base"),
        ("rlhf_reward_model", "OpenAssistant/reward-model-deberta-v3-large-v2"),
        ("reciprocate_reward_model", "reciprocate/gpt-j_rm_format-oa"),
        ("relevance_filter", "bert-base-uncased"),
        ("relevance_filter", "sentence-transformers/all-mpnet-base-v2"),
        ("diversity_reward_model", "sentence-transformers/all-mpnet-base-v2"),
        ("nsfw_filter", "facebook/roberta-hate-speech-dynabench-r4-target"),
    }  # Dahoas and the judge are off in the default stack
    rec = got[("reciprocate_reward_model", "reciprocate/gpt-j_rm_format-oa")]
    assert rec["requested_revision"] == "501f895"  # openvalidators' own pin, resolved to its commit
    assert rec["commit"] == fake_commit("reciprocate/gpt-j_rm_format-oa", "501f895")
    assert [e["model"] for e in lock["models"] if e["trust_remote_code"]] == ["dpo_reward_model"]
    assert sorted(fake.fetched) == sorted((e["hub_id"], e["commit"]) for e in lock["models"])
    assert "lock file written" in capsys.readouterr().out


def test_download_all_includes_models_that_are_off(default_toml: Path, fake: FakeHub) -> None:
    _, entries = hub.download(load_config(default_toml), include_off=True, fetch=False)
    ids = {(e.model, e.hub_id) for e in entries}
    assert ("dahoas_reward_model", "Dahoas/gptj-rm-static") in ids
    assert ("dahoas_reward_model", "EleutherAI/gpt-j-6b") in ids  # its base config is a hub id too
    assert ("prompt_reward_model", "VMware/open-llama-7b-open-instruct") in ids
    assert fake.fetched == []


def test_loading_uses_the_locked_commits(default_toml: Path, fake: FakeHub, capsys: pytest.CaptureFixture) -> None:
    hub.download(load_config(default_toml))
    cfg = load_config(default_toml)
    rec = cfg.models["reciprocate_reward_model"]
    commit = fake_commit("reciprocate/gpt-j_rm_format-oa", "501f895")
    assert rec.locked == {"reciprocate/gpt-j_rm_format-oa": commit}
    source, how = hub.load_source(rec, rec.path)  # fetched: the snapshot folder of that commit
    assert source == str(fake.snapshot("reciprocate/gpt-j_rm_format-oa", commit)) and how == {"trust_remote_code": False}
    shutil.rmtree(source)  # not on disk: the hub id at the locked commit
    assert hub.load_source(rec, rec.path) == (rec.path, {"revision": commit, "trust_remote_code": False})
    assert cli.main(["config", "--config", str(default_toml)]) == 0
    assert f"reciprocate/gpt-j_rm_format-oa@{commit[:12]}" in capsys.readouterr().out


def test_a_stale_lock_is_an_error(default_toml: Path, fake: FakeHub) -> None:
    hub.download(load_config(default_toml), fetch=False)
    default_toml.write_text(default_toml.read_text().replace('revision = "501f895"', 'revision = "main"'))
    with pytest.raises(ConfigError, match=r"models\.reciprocate_reward_model\.revision.*rewardstack download"):
        load_config(default_toml)


def test_a_commit_that_is_not_a_hash_is_refused(default_toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeHub(tmp_path / "c", bad={"bert-base-uncased": "main"})
    with pytest.raises(ModelLoadError, match="40 hex digits"):
        hub.download(load_config(default_toml), client=client, fetch=False)
    assert not (default_toml.parent / "stack.lock.json").exists()
    (default_toml.parent / "stack.lock.json").write_text(json.dumps(
        {"version": 1, "models": [{"model": "nsfw_filter", "hub_id": "x/y", "requested_revision": None, "commit": "abc"}]}))
    with pytest.raises(ConfigError, match="40 hex digits"):
        load_config(default_toml)


def test_remote_code_without_a_lock_is_refused() -> None:
    cfg = default_config().models["dpo_reward_model"]
    assert cfg.trust_remote_code and not cfg.locked
    with pytest.raises(ModelLoadError, match=r"trust_remote_code.*rewardstack download"):
        dpo.build(cfg, make_runtime())  # refused before anything is fetched or run


def test_locked_remote_code_standin_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id needing remote code: refused, then `download` (fake hub) locks it, then it loads and scores."""
    source = make_btlm_checkpoint(tmp_path / "published", max_length=128)
    client = FakeHub(tmp_path / "hubcache", sources={"standin/btlm-tiny": source})
    monkeypatch.setattr(hub, "default_client", lambda: client)
    config = tmp_path / "remote.toml"
    config.write_text(
        '[models.dpo_reward_model]\npath = "standin/btlm-tiny"\nweight = 1.0\ndtype = "float32"\n'
        "trust_remote_code = true\ntune_logits_chunk = false\n"
        "[models.rlhf_reward_model]\nweight = 0\n[models.reciprocate_reward_model]\nweight = 0\n"
        "[models.relevance_filter]\nenabled = false\n[models.diversity_reward_model]\nenabled = false\n"
        "[models.nsfw_filter]\nenabled = false\n",
        encoding="utf-8",
    )
    with pytest.raises(ModelLoadError, match="rewardstack download"):
        dpo.build(load_config(config).models["dpo_reward_model"], make_runtime())
    assert cli.main(["download", "--config", str(config)]) == 0
    commit = fake_commit("standin/btlm-tiny", None)
    mc = load_config(config).models["dpo_reward_model"]
    assert mc.locked == {"standin/btlm-tiny": commit}
    sc = dpo.build(mc, make_runtime())
    assert type(sc.model).__module__.startswith("transformers_modules.")
    res = sc.score(ScoreRequest("A prompt about cats and", ["dogs that chase them all day long", "x"]))
    assert math.isfinite(res.scores[0]) and res.scores[1] == -11.0
