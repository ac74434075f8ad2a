"""Pinned hub revisions and opted-in remote code: the lock file, `rewardstack download`, and where each
checkpoint is loaded from.

`rewardstack download --config C` resolves every hub id the config names (each model's `path` or
`paths`, and Dahoas's `base_config`) to the commit the hub serves for its requested revision,
fetches the files at that commit, and writes `C.lock.json` beside the config (like a package lock):

    {"version": 1, "config": "stack.toml", "models": [
      {"model": "dpo_reward_model", "hub_id": "cerebras/btlm-3b-8k-base", "requested_revision": null,
       "commit": "<40 hex digits from the hub>", "trust_remote_code": true}, ...]}

`load_config` applies the lock (`apply_lock`): every locked hub id then loads at its commit, from the
fetched snapshot when it is on disk. Remote code (`trust_remote_code = true` on a model) runs only
from a locked commit or from a local folder the operator named; a hub model that asks for remote
code without a locked commit is refused with a message saying to run `rewardstack download`.
Models are fixed by the operator's config at load: nothing in a scoring request names a model,
a revision or code.

The hub is reached through a `HubClient` (resolve, fetch, find a fetched snapshot). The real one
wraps huggingface_hub; tests inject a fake. No commit is ever made up here: a commit comes from the
client and must be 40 hex digits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rewardstack.config import ALL_MODELS, hub_ids
from rewardstack.errors import ConfigError, ModelLoadError
from rewardstack._lockfile import COMMIT, LockEntry, is_hub_id, lock_path, write_lock

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import ModelConfig, StackConfig

log = logging.getLogger("rewardstack.hub")


class HubClient(Protocol):
    """What `download` and loading need from the model hub."""

    def resolve(self, repo_id: str, revision: str | None) -> str:
        """The full commit hash the hub serves for `revision` (None: the default branch)."""

    def fetch(self, repo_id: str, commit: str) -> Path:
        """Download the repository's files at `commit`; the local snapshot folder."""

    def snapshot(self, repo_id: str, commit: str) -> Path | None:
        """The local snapshot folder of `commit` if it was fetched before, else None (no network)."""


class HuggingFaceHub:
    """`HubClient` over huggingface_hub (`HfApi.model_info` and `snapshot_download`)."""

    def resolve(self, repo_id: str, revision: str | None) -> str:
        from huggingface_hub import HfApi

        return str(HfApi().model_info(repo_id, revision=revision).sha)

    def fetch(self, repo_id: str, commit: str) -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=commit))

    def snapshot(self, repo_id: str, commit: str) -> Path | None:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id, revision=commit, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the cache (the library raises several types)
            return None


def default_client() -> HubClient:
    """The client loading and `download` use unless given one (tests replace this)."""
    return HuggingFaceHub()


def download(cfg: "StackConfig", *, client: HubClient | None = None, include_off: bool = False,
             fetch: bool = True) -> tuple[Path, list[LockEntry]]:
    """Resolve, fetch and lock every hub id of the config's models; returns (lock file, entries).

    Models that are off are skipped unless `include_off`. `fetch=False` resolves and locks only.
    """
    if cfg.source is None:
        raise ConfigError("<file>", "download needs a config file (the lock file is written beside it)")
    client = client or default_client()
    entries: list[LockEntry] = []
    for name in (*ALL_MODELS, *(m.name for m in cfg.user_rewards())):  # user-named reward models lock too
        mc = cfg.models[name]
        if not (mc.active or include_off):
            continue
        for repo in hub_ids(mc):
            requested = mc.revision if repo in ([mc.path] if mc.path else []) + list(mc.paths) else None
            try:
                commit = client.resolve(repo, requested)
            except Exception as e:  # noqa: BLE001 - network and hub errors of many types
                raise ModelLoadError(f"cannot resolve {repo!r} at {requested or 'the default branch'}: {e}") from e
            if not isinstance(commit, str) or not COMMIT.fullmatch(commit):  # never a commit made up here
                raise ModelLoadError(f"the hub gave {commit!r} as the commit of {repo!r}; expected 40 hex digits")
            log.info("%s: %s %s -> commit %s", name, repo, requested or "(default branch)", commit)
            if fetch:
                try:
                    folder = client.fetch(repo, commit)
                except Exception as e:  # noqa: BLE001
                    raise ModelLoadError(f"cannot fetch {repo!r} at {commit}: {e}") from e
                log.info("%s: fetched %s@%s into %s", name, repo, commit[:12], folder)
            entries.append(LockEntry(name, repo, requested, commit, bool(mc.trust_remote_code)))
    lock_file = lock_path(cfg.source)
    write_lock(lock_file, entries, config_name=cfg.source.name)
    return lock_file, entries


def load_source(cfg: "ModelConfig", path: str, *, client: HubClient | None = None) -> tuple[str, dict[str, Any]]:
    """(what to pass to `from_pretrained`, its keyword arguments) for one checkpoint of a model.

    The keywords always say `trust_remote_code` explicitly (False unless the config opts in), so
    transformers never stops to ask. Raises ModelLoadError for remote code without a locked commit.
    """
    trust = bool(cfg.trust_remote_code)
    if not is_hub_id(path):
        if trust:
            log.info("%s: running the model's own code from the local folder %s (trust_remote_code, "
                     "folder given by the operator)", cfg.name, path)
        return path, {"trust_remote_code": trust}
    commit = cfg.locked.get(path)
    if commit is None:
        if trust:
            raise ModelLoadError(
                f"models.{cfg.name}: {path} needs its own code (trust_remote_code = true), which runs only "
                f"from a locked commit; run `rewardstack download --config <your config>` to resolve, fetch "
                f"and lock it"
            )
        log.info("%s: %s is not locked; loading %s as the hub serves it today (`rewardstack download` pins it)",
                 cfg.name, path, cfg.revision or "the default branch")
        return path, {"revision": cfg.revision, "trust_remote_code": False}
    folder = (client or default_client()).snapshot(path, commit)
    where = f"fetched snapshot {folder}" if folder is not None else "the hub"
    log.info("%s: %s%s at locked commit %s (from %s)", cfg.name, "running the model's own code of " if trust else "",
             path, commit, where)
    if folder is not None:
        return str(folder), {"trust_remote_code": trust}
    return path, {"revision": commit, "trust_remote_code": trust}
