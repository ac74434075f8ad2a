"""A namespace's writer session and its sequence rules: the one place a step is admitted, applied and kept.

Both servers call this module, so they cannot drift: `rewardstack serve`'s worker thread
(service/worker.py) and Ray Serve's namespace state actors (distributed/serve.py). Each holds a
namespace's `RewardState` and asks here what to do with a step:

- **Sessions fence the old writer**, as Kafka's idempotent producer does with epochs. A client opens
  a session on a namespace (`open_session`) and gets an epoch and the next sequence number, counted
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
- **Applying** (`apply_step`) runs the stateful half of the stack as the next number and keeps the
  answer with the digest of the whole step (`step_digest`), so a retry is told from another step.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Mapping

from rewardstack._fileio import event_line
from rewardstack._jsonio import canonical_chunks
from rewardstack._readview import ReadView
from rewardstack._service.errors import ServiceError
from rewardstack._rewardstate import ForwardResult, RewardState
from rewardstack._stepresult import StepResult
from rewardstack._wire import RECENT_RESULTS, Step

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


def open_session(state: RewardState, client: Mapping[str, Any], now: float | None = None) -> dict[str, Any]:
    """Open a new session on the namespace, fencing the one before: the answer to send. The
    caller commits the state to disk before it answers."""
    now = time.time() if now is None else now
    previous = dict(state.session) or None
    epoch = max(epoch_of(state) + 1, int(now * 1000))
    state.session = {"epoch": epoch, **{k: client.get(k) for k in CLIENT_FIELDS}, "opened_at": now, "last_step_at": None}
    return {**describe(state), "previous": previous}


def describe(state: RewardState) -> dict[str, Any]:
    """Where a namespace stands: its committed and next sequence, its epoch and the session's holder."""
    holder = {k: state.session.get(k) for k in (*CLIENT_FIELDS, "opened_at", "last_step_at")} if state.session else None
    return {"sequence": state.sequence, "next": state.sequence + 1, "epoch": epoch_of(state), "holder": holder}


def _who(session: Mapping[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(session.get("opened_at") or 0)))
    return (f"client '{session.get('client')}' (host {session.get('host')}, pid {session.get('pid')}) "
            f"at {when} (epoch {session.get('epoch')})")


def fenced(namespace: str, epoch: int, session: Mapping[str, Any]) -> ServiceError:
    """409: a step of an older epoch; another client took the namespace over."""
    return ServiceError(409, "fenced", f"namespace '{namespace}' was taken over by {_who(session)}; this client's "
                        f"session (epoch {epoch}) is fenced and its step was not scored. Two validators are using one "
                        "namespace: stop one, or give each its own namespace", field="epoch")


def session_unknown(namespace: str, epoch: int, current: int) -> ServiceError:
    """409: an epoch the service never issued (its state of the namespace was reset or moved)."""
    return ServiceError(409, "session_unknown", f"namespace '{namespace}' has no session of epoch {epoch} (its "
                        f"current epoch is {current}): the service's state of it was reset; open a new session",
                        field="epoch")


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
        if epoch < current:
            raise fenced(namespace, epoch, state.session)
        if epoch > current:
            raise session_unknown(namespace, epoch, current)
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

def apply_step(state: RewardState, fwd: ForwardResult, max_chars: int | None) -> tuple[StepResult, str]:
    """Apply one forward result as the namespace's next sequence number and keep the answer for
    retries (with the whole step's digest); the result and the answer's body. The caller commits
    the state to disk before it answers."""
    result = state.apply(fwd)
    body = response_body(result.event, state.sequence)
    state.remember(state.sequence, f"{body}\n{step_digest(fwd.step, max_chars)}")
    if state.session:
        state.session["last_step_at"] = time.time()
    return result, body


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
        step = ReadView.of(step, max_chars).step
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


__all__ = ["AHEAD", "CLIENT_FIELDS", "GO", "PENDING", "admit", "apply_step", "describe", "epoch_of", "fenced",
           "keep_memory", "kept_memory", "memory_header", "open_session", "response_body", "sequence_conflict",
           "sequence_gap", "session_unknown", "step_digest"]
