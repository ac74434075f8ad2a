"""Per-client state for the scoring service: namespaces, their state on disk, and token bindings.

Each validator that talks to one service is a namespace: its own normalizers, blacklist, diversity
history and committed sequence number (a `RewardState`), kept in `<state_dir>/namespaces/<name>/`
through the library's `StateStore` (one atomic file per namespace: a kill leaves the old state or
the new one). Names match `[A-Za-z0-9_-]{1,64}` because each becomes a directory.

Only the scoring worker thread reads or writes a namespace's state, so steps of one namespace are
applied strictly in the order the worker takes them, and no lock is needed on the state itself.

Tokens: a tokens file is a TOML table mapping the SHA-256 hex digest of a bearer token to the one
namespace it may use. `REWARDSTACK_TOKEN` (environment) is a token that may use every namespace.
Presented tokens are hashed and compared against every configured hash with `hmac.compare_digest`,
with no early exit, so the time taken says nothing about which hash came close.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rewardstack.config import StackConfig
from rewardstack.errors import ConfigError, RewardStackError, StateError
from rewardstack._rewardstate import RewardState
from rewardstack._state import StateLock, StateStore

log = logging.getLogger("rewardstack.service")

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_NAMESPACE = "default"
TOKEN_ENV = "REWARDSTACK_TOKEN"
ALL_NAMESPACES = "*"
MIN_TOKEN_CHARS = 16
"""Shortest `REWARDSTACK_TOKEN` accepted: a shorter one can be guessed by trying (the tokens file
holds digests, whose tokens cannot be measured; its owner makes them)."""


def valid_name(name: object) -> bool:
    """Whether `name` may be a namespace (and so a directory name)."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


class NamespaceLimitError(RewardStackError):
    """A new namespace would pass `service.max_namespaces`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the service holds {limit} namespaces (service.max_namespaces)")
        self.limit = limit


CREATE_LOCK = ".create.lock"


def reserve(root: Path, name: str, limit: int) -> None:
    """Create the folder of namespace `name` under `root` unless `limit` namespaces exist already.

    Counting and creating happen under an exclusive `flock` on `<root>/.create.lock`, so
    concurrent first requests (threads, processes, Ray replicas on one shared folder) cannot
    together create more than `limit`. An existing namespace always passes. Raises
    NamespaceLimitError.
    """
    if not valid_name(name):  # callers check first; this keeps a bad name off the filesystem
        raise ValueError(f"invalid namespace name {name!r}")
    folder = root / name
    if folder.is_dir():
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / CREATE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if folder.is_dir():
            return
        existing = sum(1 for p in root.iterdir() if p.is_dir() and valid_name(p.name))
        if existing >= limit:
            raise NamespaceLimitError(limit)
        folder.mkdir()
    finally:
        os.close(fd)  # releases the flock


def token_hash(token: str) -> str:
    """The SHA-256 hex digest of a token: what a tokens file stores, never the token itself."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass
class Namespace:
    """One client's state and where it lives on disk."""

    name: str
    state: RewardState
    store: StateStore
    lock: StateLock | None = None
    """Held while the namespace is loaded: one writer per state directory, across processes."""

    def commit(self) -> None:
        """Atomically write the state (normalizers, blacklist, history, sequence, recent results)."""
        self.store.save(self.state.state_dict())

    def reload(self) -> None:
        """Back to what is on disk (after a failed commit: memory must not run ahead of the file)."""
        fresh = RewardState(self.state.config)
        fresh.load_state_dict(self.store.load())
        self.state = fresh


class Namespaces:
    """The namespaces of one service, loaded from disk on first use and kept in memory."""

    def __init__(self, config: StackConfig, *, max_namespaces: int = 64) -> None:
        self.config = config
        self.root = Path(config.state_dir) / "namespaces"
        self.max_namespaces = max_namespaces
        self._loaded: dict[str, Namespace] = {}

    def on_disk(self) -> list[str]:
        """Names of the namespaces that have a state folder."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and valid_name(p.name))

    def known(self, name: str) -> bool:
        """Whether the namespace is loaded or has state on disk."""
        return name in self._loaded or (self.root / name).is_dir()

    def count(self) -> int:
        """How many namespaces exist (loaded or on disk)."""
        return len(set(self._loaded) | set(self.on_disk()))

    def get(self, name: str) -> Namespace:
        """The namespace, restored from its state file on first use (created if new).

        Raises StateError if unreadable, NamespaceLimitError for a new one past `max_namespaces`.
        """
        ns = self._loaded.get(name)
        if ns is not None:
            return ns
        reserve(self.root, name, self.max_namespaces)  # NamespaceLimitError past the limit
        store = StateStore(self.root / name)
        lock = StateLock(self.root / name).acquire()  # StateLockedError if another process has it
        state = RewardState(self.config)
        try:
            state.load_state_dict(store.load())
        except StateError as e:
            lock.release()
            raise StateError(f"namespace '{name}': {e}") from e
        ns = self._loaded[name] = Namespace(name, state, store, lock)
        if state.sequence:
            log.info("namespace %s resumed at sequence %d", name, state.sequence)
        return ns

    def peek(self, name: str) -> Namespace | None:
        """The namespace if it exists (restored from its folder on first use), None if it was never
        created. Looking creates nothing: only a step that will be scored may make a namespace.

        Raises StateError if its state is unreadable.
        """
        if name in self._loaded or (self.root / name).is_dir():
            return self.get(name)
        return None

    def discard(self, name: str) -> None:
        """Forget a namespace that never committed a step (its only steps failed), and remove its
        folder, so that a request that was not applied leaves nothing behind and uses no slot."""
        ns = self._loaded.get(name)
        if ns is None or ns.state.sequence or ns.store.path.exists():
            return
        del self._loaded[name]
        if ns.lock is not None:
            ns.lock.release()
            ns.lock.path.unlink(missing_ok=True)
        try:
            ns.store.dir.rmdir()  # only if empty: never deletes anything another writer put there
        except OSError:
            log.warning("namespace %s: could not remove its empty folder %s", name, ns.store.dir)

    def loaded(self) -> list[Namespace]:
        """The namespaces in memory."""
        return list(self._loaded.values())

    def release(self) -> None:
        """Drop every namespace's lock (at shutdown, after the last commit)."""
        for ns in self._loaded.values():
            if ns.lock is not None:
                ns.lock.release()


@dataclass
class Access:
    """Who may call the service: unbound tokens (any namespace) and tokens bound to one namespace."""

    hashes: dict[str, str]
    """Token SHA-256 hex digest -> namespace (ALL_NAMESPACES for the environment's token)."""

    @property
    def required(self) -> bool:
        """Whether requests must carry a bearer token (some token is configured)."""
        return bool(self.hashes)

    def namespace_of(self, token: str | None) -> str | None:
        """The namespace `token` may use (ALL_NAMESPACES for any), or None if it is not valid."""
        if token is None:
            return None
        presented = token_hash(token).encode()
        found: str | None = None
        for digest, namespace in self.hashes.items():
            # Every hash is compared, match or not: no early exit.
            if hmac.compare_digest(presented, digest.encode()) and found is None:
                found = namespace
        return found

    @classmethod
    def load(cls, tokens_file: str | None, *, environ: dict[str, str] | None = None) -> "Access":
        """Tokens from `REWARDSTACK_TOKEN` and the tokens file (never from the command line)."""
        env = os.environ if environ is None else environ
        hashes: dict[str, str] = {}
        token = env.get(TOKEN_ENV)
        if token:
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(f"${TOKEN_ENV}", f"the token is {len(token)} character(s) long; a token needs at "
                                  f"least {MIN_TOKEN_CHARS} characters (make one with: python -c 'import secrets; "
                                  "print(secrets.token_urlsafe(32))')")
            hashes[token_hash(token)] = ALL_NAMESPACES
        if tokens_file:
            path = Path(tokens_file)
            try:
                table = tomllib.loads(path.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError("service.tokens_file", f"cannot read {path}: {e}") from e
            for digest, namespace in table.items():
                if not re.fullmatch(r"[0-9a-f]{64}", digest):
                    raise ConfigError("service.tokens_file", f"key {digest!r} is not a SHA-256 hex digest of a token")
                if not valid_name(namespace):
                    raise ConfigError("service.tokens_file", f"namespace {namespace!r} of a token must match {NAME_RE.pattern}")
                hashes[digest] = namespace
        return cls(hashes)


def stored_state(config: StackConfig, folder: Path) -> RewardState:
    """A namespace's state as committed in `folder` (empty when it has none), read without taking it
    over (no lock: a reader of a file replaced atomically sees the old state or the new)."""
    state = RewardState(config)
    state.load_state_dict(StateStore(folder).load())
    return state


def is_loopback(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
