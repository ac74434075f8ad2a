"""Per-client state for the scoring service: namespaces, their state on disk, their writer sessions
and sequence rules (the one place a step is admitted, applied and kept). Who may use which
namespace (bearer tokens) is service/access.py's.

Each validator that talks to one service is a namespace: its own normalizers, blacklist, diversity
history and committed sequence number (a `RewardState`), kept in `<state_dir>/namespaces/<name>/`
through the library's `StateStore` (one atomic file per namespace: a kill leaves the old state or
the new one). Names match `[A-Za-z0-9_-]{1,64}` because each becomes a directory.

Only the scoring worker thread reads or writes a namespace's state, so steps of one namespace are
applied strictly in the order the worker takes them, and no lock is needed on the state itself.

Both servers admit and apply steps here, so they cannot drift: `rewardstack serve`'s worker thread
(service/worker.py) and Ray Serve's namespace state actors (distributed/serve.py). Each holds a
namespace's `RewardState` and asks here what to do with a step:

- **Sessions fence the old writer**, as Kafka's idempotent producer does with epochs. A client opens
  a session on a namespace (`Namespace.open_session`) and gets an epoch and the next sequence number, counted
  after every step the namespace admitted before it. Every later step carries the epoch. A step of
  an older epoch is refused as `fenced`, naming the client (host, pid, name) that took the
  namespace over and when, so two validators on one namespace fence each other loudly. A step of an
  epoch the service never issued is `session_unknown`: the service lost the namespace's state (a
  wiped folder, a new box), and the client opens a new session. An epoch is at least the opening
  time in milliseconds, so a wiped service never issues an epoch an old client still holds.
- **Sequence numbers make retries safe**: `admit` says whether a step is the next one (`GO`), a
  retry of a committed step (its kept answer, byte for byte), another step reusing a committed
  number (409 `sequence_conflict`), a number between the committed one and the next (`PENDING`: a
  step of the same turn or still in a forward pass) or one that skips ahead (`AHEAD`). The worker
  answers `PENDING` from its turn and `AHEAD` with 409 `sequence_gap`; a state actor waits for the
  predecessors of an `AHEAD` step, which replicas finish out of order.
- **Applying** (`Namespace.apply`) runs the stateful half of the stack as the next number and keeps the
  answer with the digest of the whole step (`step_digest`), so a retry is told from another step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Mapping

from rewardstack.config import StackConfig
from rewardstack.errors import StateError
from rewardstack._fileio import canonical_chunks, event_line
from rewardstack._state import ForwardResult, RewardState, StateLock, StateLockedError, StateStore
from rewardstack._service.errors import ServiceError
from rewardstack._stepobservers import StepResult
from rewardstack._wire import RECENT_RESULTS, Step

log = logging.getLogger("rewardstack.service")

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_NAMESPACE = "default"


def valid_name(name: object) -> bool:
    """Whether `name` may be a namespace (and so a directory name)."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def namespace_limit(limit: int) -> ServiceError:
    """403: a new namespace past `service.max_namespaces`."""
    return ServiceError(403, "namespace_limit", f"the service holds {limit} namespaces (service.max_namespaces); "
                        "no new one can be made; the step was not scored", field="namespace")


def reserve(root: Path, name: str, limit: int) -> None:
    """Create the folder of namespace `name` under `root` unless `limit` namespaces exist already.

    Counting and creating happen under the one file lock (`StateLock`, waiting) on
    `<root>/.create.lock`, so concurrent first requests (threads, processes, Ray replicas on one
    shared folder) cannot together create more than `limit`. An existing namespace always passes.
    Raises the 403 `namespace_limit`.
    """
    if not valid_name(name):  # callers check first; this keeps a bad name off the filesystem
        raise ValueError(f"invalid namespace name {name!r}")
    folder = root / name
    if folder.is_dir():
        return
    with StateLock(root, name=".create.lock", wait=True):
        if folder.is_dir():
            return
        existing = sum(1 for p in root.iterdir() if p.is_dir() and valid_name(p.name))
        if existing >= limit:
            raise namespace_limit(limit)
        folder.mkdir()


class Namespace:
    """One client's state, the folder it lives in, and the one place it changes: a step applied
    (`apply`), a session opened (`open_session`), a commit (`commit`). The worker and Ray Serve's
    state actors hold their namespaces through this class."""

    def __init__(self, config: StackConfig, root: Path, name: str) -> None:
        """Take the namespace's lock (StateLockedError if another process has it) and restore its
        state from `<root>/<name>` (StateError if unreadable)."""
        self.name = name
        self.store = StateStore(root / name)
        self.lock = StateLock(root / name).acquire()
        """Held while the namespace is loaded: one writer per state directory, across processes."""
        self.state = RewardState(config)
        try:
            self.state.load_state_dict(self.store.load())
        except StateError as e:
            self.lock.release()
            raise StateError(f"namespace '{name}': {e}") from e
        if self.state.sequence:
            log.info("namespace %s resumed at sequence %d", name, self.state.sequence)

    def commit(self) -> bool:
        """Atomically write the state (normalizers, blacklist, history, sequence, kept answers, session).
        False when that failed: memory is then back to what the file holds (it must not run ahead)."""
        try:
            self.store.save(self.state.state_dict())
        except Exception:  # noqa: BLE001 - logged; the caller answers that nothing was committed
            log.exception("namespace %s: commit failed", self.name)
            self.reload()
            return False
        return True

    def reload(self) -> None:
        """Back to what is on disk (after a failed commit or apply)."""
        self.state = stored_state(self.state.config, self.store.dir)

    def apply(self, fwd: ForwardResult) -> tuple[StepResult, str]:
        """Apply one forward result as the next sequence number and keep its answer for retries (with
        the whole step's digest): the result and the answer's body. The caller commits before it
        answers. A step that fails to apply raises, with memory back to the file."""
        state = self.state
        try:
            result = state.apply(fwd)
            body = response_body(result.event, state.sequence)
            state.remember(state.sequence, f"{body}\n{step_digest(fwd.step, state.config.input.max_chars)}")
        except Exception:
            log.exception("namespace %s: applying a step failed", self.name)
            self.reload()
            raise
        if state.session:
            state.session["last_step_at"] = time.time()
        return result, body

    def open_session(self, client: Mapping[str, Any]) -> dict[str, Any]:
        """Open a new session, fencing the one before, and commit it: the answer to send. Raises a
        500 `state_error` (nothing opened) when the commit fails."""
        now = time.time()
        previous = dict(self.state.session) or None
        epoch = max(epoch_of(self.state) + 1, int(now * 1000))
        self.state.session = {"epoch": epoch, **{k: client.get(k) for k in CLIENT_FIELDS}, "opened_at": now,
                              "last_step_at": None}
        if not self.commit():
            raise ServiceError(500, "state_error", "the session could not be committed; it was not opened")
        if previous:
            log.warning("namespace %s: client '%s' (host %s, pid %s) opened epoch %d, fencing client '%s' (host %s, "
                        "pid %s)", self.name, client.get("client"), client.get("host"), client.get("pid"), epoch,
                        previous.get("client"), previous.get("host"), previous.get("pid"))
        return {**describe(self.state), "previous": previous}


class Namespaces:
    """The namespaces of one service, loaded from disk on first use and kept in memory."""

    def __init__(self, config: StackConfig, *, max_namespaces: int = 64) -> None:
        self.config = config
        self.root = Path(config.state_dir) / "namespaces"
        self.max_namespaces = max_namespaces
        self._loaded: dict[str, Namespace] = {}
        self._reported: dict[str, str] = {}  # namespace -> the state error logged for it (`unreadable`)

    def on_disk(self) -> list[str]:
        """Names of the namespaces that have a state folder."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and valid_name(p.name))

    def get(self, name: str) -> Namespace:
        """The namespace, restored from its state file on first use (created if new).

        Raises the 500 `state_unreadable` if its state file cannot be read (`unreadable`),
        StateLockedError if another process holds it, the 403 `namespace_limit` for a new one past
        `max_namespaces`.
        """
        ns = self._loaded.get(name)
        if ns is None:
            reserve(self.root, name, self.max_namespaces)
            try:
                ns = self._loaded[name] = Namespace(self.config, self.root, name)
            except StateLockedError:
                raise
            except StateError as e:
                raise self.unreadable(name, e) from None
            self._reported.pop(name, None)
        return ns

    def unreadable(self, name: str, error: StateError) -> ServiceError:
        """The answer to a request for a namespace whose state file cannot be read, saying what to do;
        logged once per namespace and error (every request for it fails the same way until it is fixed)."""
        message = (f"{error}. Every request for namespace '{name}' is refused until its state can be read: "
                   "restore the file from a backup, or move it aside to start the namespace afresh (its "
                   "normalizers, blacklist and sequence numbers start over; the validator opens a new session). "
                   "Nothing was scored")
        if self._reported.get(name) != str(error):
            self._reported[name] = str(error)
            log.error("%s", message)
        return ServiceError(500, "state_unreadable", message, field="namespace")

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
            ns.lock.release()


def stored_state(config: StackConfig, folder: Path) -> RewardState:
    """A namespace's state as committed in `folder` (empty when it has none), read without taking it
    over (no lock: a reader of a file replaced atomically sees the old state or the new)."""
    state = RewardState(config)
    state.load_state_dict(StateStore(folder).load())
    return state


GO = "go"
"""`admit`: the step is the namespace's next one; score it."""
PENDING = "pending"
"""`admit`: the number is taken by a step admitted but not yet committed (same turn, or in flight)."""
AHEAD = "ahead"
"""`admit`: the number skips past the next one."""

CLIENT_FIELDS = ("client", "host", "pid")
"""What a client says of itself when it opens a session (shown to the writer it fences)."""


# -- sessions ----------------------------------------------------------------------------------

def epoch_of(state: RewardState) -> int:
    """The namespace's current epoch (0: no session was ever opened)."""
    return int(state.session.get("epoch", 0))


def describe(state: RewardState) -> dict[str, Any]:
    """Where a namespace stands: its committed and next sequence, its epoch and the session's holder."""
    holder = {k: state.session.get(k) for k in (*CLIENT_FIELDS, "opened_at", "last_step_at")} if state.session else None
    return {"sequence": state.sequence, "next": state.sequence + 1, "epoch": epoch_of(state), "holder": holder}


def _who(session: Mapping[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(session.get("opened_at") or 0)))
    return (f"client '{session.get('client')}' (host {session.get('host')}, pid {session.get('pid')}) "
            f"at {when} (epoch {session.get('epoch')})")


# -- admission ---------------------------------------------------------------------------------

def admit(state: RewardState, namespace: str, step: Step, *, sequence: int | None, epoch: int | None,
          expected: int, max_chars: int | None) -> str:
    """What to do with `step` sent as `sequence` in session `epoch`: `GO`, `PENDING`, `AHEAD`, or
    the kept answer of a committed step (a retry). Raises the ServiceError that refuses it.

    `expected` is the number the step would be applied as: one past the committed sequence, plus
    the steps admitted before it that have not committed yet (the worker's turn).
    """
    if epoch is not None:
        current = epoch_of(state)
        if epoch < current:  # another client took the namespace over
            raise ServiceError(409, "fenced", f"namespace '{namespace}' was taken over by {_who(state.session)}; this "
                               f"client's session (epoch {epoch}) is fenced and its step was not scored. Two validators "
                               "are using one namespace: stop one, or give each its own namespace", field="epoch")
        if epoch > current:  # an epoch the service never issued (its state of the namespace was reset or moved)
            raise ServiceError(409, "session_unknown", f"namespace '{namespace}' has no session of epoch {epoch} (its "
                               f"current epoch is {current}): the service's state of it was reset; open a new session",
                               field="epoch")
    if sequence is None or sequence == expected:
        return GO
    if sequence > expected:
        return AHEAD
    if sequence > state.sequence:
        return PENDING
    stored = state.recent.get(sequence)
    if stored is None:
        raise sequence_gap(namespace, sequence, expected)
    answer, digest, _ = _parts(stored)
    if digest != step_digest(step, max_chars):
        raise sequence_conflict(namespace, sequence, expected)
    return answer


def sequence_conflict(namespace: str, got: int, expected: int) -> ServiceError:
    """409: `got` was committed with a different step."""
    return ServiceError(409, "sequence_conflict", f"sequence {got} of namespace '{namespace}' was committed with "
                        f"a different step; the next sequence is {expected}", field="sequence")


def sequence_gap(namespace: str, got: int, expected: int) -> ServiceError:
    """409: `got` is too old to have its result kept, or skips ahead of `expected`."""
    if got < expected:
        msg = (f"sequence {got} of namespace '{namespace}' was committed but its result is no longer kept "
               f"(only the last {RECENT_RESULTS} are); the next sequence is {expected}")
    else:
        msg = f"sequence {got} skips ahead: namespace '{namespace}' expects sequence {expected} next"
    return ServiceError(409, "sequence_gap", msg, field="sequence")


# -- applying and keeping ----------------------------------------------------------------------

def keep_memory(state: RewardState, sequence: int, memory: Mapping[str, Any]) -> None:
    """Keep a committed step's memory record beside its answer, so that a retry gets it too (on
    disk with the namespace's next commit)."""
    stored = state.recent.get(sequence)
    if stored is not None:
        answer, digest, _ = _parts(stored)
        state.recent[sequence] = f"{answer}\n{digest}\n{memory_header(memory)}"


def kept_memory(state: RewardState, sequence: int) -> dict[str, Any] | None:
    """The memory record kept with a committed step's answer, if any."""
    stored = state.recent.get(sequence)
    memory = _parts(stored)[2] if stored is not None else None
    return json.loads(memory) if memory else None


def _parts(stored: str) -> tuple[str, str, str | None]:
    """A kept answer's body, step digest and memory record (one JSON line each: the event writer
    escapes every line break)."""
    parts = stored.split("\n")
    return parts[0], parts[1], (parts[2] if len(parts) > 2 else None)


def response_body(event: dict[str, Any], sequence: int) -> str:
    """Exactly the event line `rewardstack score` writes, plus the sequence it was applied as."""
    line = event_line(event).rstrip("\n")
    return f'{line[:-1]}, "sequence": {sequence}}}'


def step_digest(step: Step, max_chars: int | None = None) -> str:
    """SHA-256 of the step as committed: every field that changes what applying it does.

    The event cannot tell a retry from another step: it echoes a failed completion (`null`) and an
    empty one alike as `""`, and leaves out `new_forward_pass`. So the digest covers the step
    itself, with defaults made explicit (no base prompt is the prompt, no `new_forward_pass` is
    whether the step is `augment`, no uids are 0..n-1) so that two spellings of one step agree.
    `max_chars` (`[input] max_chars`): the step as read, each text cut there, as it was committed.
    """
    if max_chars is not None:
        step = step.as_read(max_chars)
    whole = {
        "name": step.name, "prompt": step.prompt, "completions": list(step.completions), **step.resolved(),
        "block": step.block, "gating_loss": step.gating_loss, "set_weights": step.set_weights,
        "logged_best": step.logged_best,
    }
    h = hashlib.sha256()
    for chunk in canonical_chunks(whole):  # a slice at a time: a 50 MB completion is not copied whole
        h.update(chunk)
    return h.hexdigest()


def memory_header(memory: Mapping[str, Any]) -> str:
    """A step's memory record summary as compact ASCII JSON (the answer's `MEMORY_HEADER`)."""
    return json.dumps(dict(memory), allow_nan=False, default=str, separators=(",", ":"))
