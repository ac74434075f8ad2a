"""One namespace's reward state and the stateful half of a step: `RewardState.apply(forward)`.

The stateless half (`RewardStack.forward`, every forward pass) gives a `ForwardResult` per step: raw
values per model and diversity's embeddings. `RewardState` is what one validator (namespace)
carries from step to step: the running normalizers, the blacklist, the diversity history, the
committed sequence number and the answers kept for retries. `apply` normalizes, masks and
combines one step's raw values into its rewards and event; it needs the config, never a model,
so the service and Ray Serve apply steps without going back into the stack.

The running normalizer (`RunningNormalizer`, openvalidators' `normalize_rewards` with its defects
fixed): per step, the valid raw rewards update a running count/mean/variance (capped count, so old
history fades), then each reward becomes `0.5 * (1 + erf(z / sqrt(2)))` with
`z = (r - mean) / sqrt(var)`. Fixed against the reference: a single sample has variance 0 (the
reference's NaN would stick in the statistics forever), and NaN raw rewards never enter the
statistics (they normalize to 0).

The state's file (`StateStore`, `StateLock`): everything that must outlive the process, in one
safetensors file, saved atomically and versioned.

Tensors (the diversity history) are stored as tensors; everything else (normalizer statistics,
blacklist lists, kept answers, the namespace's session, the commit journal of `rewardstack.runner`)
is one JSON document, stored as UTF-8 bytes in a uint8 tensor of the file's body (`rewardstack_json`),
not in the safetensors header, which is capped at 100 MB and escapes every non-ASCII character. A
save writes a temporary file in the same folder, fsyncs it, renames it over the old file and fsyncs
the folder, so a kill at any moment leaves either the complete old state or the complete new one.
Never pickle.

The file states its format (`FORMAT_VERSION`). Formats 1 and 2 kept the JSON in the header's
metadata; they are read as they are, and the first save over one writes the current format after
copying the original to `state.v<N>.safetensors`. A file from a newer rewardstack is refused with a
clear `StateError` and left untouched.

One writer per state directory: `StateLock` takes an exclusive lock (`filelock`'s `flock`) on
`<dir>/lock`; a second process is refused with `StateLockedError` naming the holder's pid. It is
the project's one file lock: the service's namespace limit and rescore's output folder take it too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from rewardstack.config import ALL_MODELS, MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import StateError
from rewardstack._fileio import atomic_write_bytes, fsync_dir
from rewardstack import _models as models
from rewardstack._scorers.base import ScoreRequest, ScoreResult, Status
from rewardstack._scorers.embedding import DiversityHistory, Embedding
from rewardstack._scorers.rules import BlacklistState
from rewardstack._stepobservers import StepResult
from rewardstack._wire import RECENT_BYTES, RECENT_RESULTS, Step

log = logging.getLogger("rewardstack.stack")

BLACKLIST = models.BLACKLIST.name
DIVERSITY = models.DIVERSITY.name


# -- the running normalizer ------------------------------------------------------------------------
@dataclass
class RunningNormalizer:
    """count / mean / var of everything seen so far, with `count` capped at `count_limit`."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0
    count_limit: int = 3000

    def update(self, raw: Sequence[float]) -> None:
        """Fold the finite values of `raw` into the statistics."""
        r = [float(x) for x in raw if math.isfinite(x)]
        n = len(r)
        if n == 0:
            return
        m = sum(r) / n
        v = sum((x - m) ** 2 for x in r) / (n - 1) if n > 1 else 0.0
        w_new = n / (self.count + n)
        w_old = self.count / (self.count + n)
        d = m - self.mean
        self.mean = w_new * m + w_old * self.mean
        self.var = w_new * v + w_old * self.var + w_new * w_old * d * d
        self.count = min(self.count_limit, self.count + n)

    def transform(self, raw: Sequence[float]) -> list[float]:
        """Map raw rewards through the current statistics; non-finite raw values map to 0."""
        sd = math.sqrt(self.var) if self.var > 0 else None
        out = []
        for x in raw:
            if not math.isfinite(x):
                out.append(0.0)
                continue
            z = (x - self.mean) / sd if sd is not None else (x - self.mean)
            out.append(0.5 * (1.0 + math.erf(z / math.sqrt(2.0))))
        return out

    def __call__(self, raw: Sequence[float]) -> list[float]:
        """Update with `raw`, then transform it (the reference's order)."""
        self.update(raw)
        return self.transform(raw)

    def to_dict(self) -> dict:
        """JSON-able state."""
        return {"count": self.count, "mean": self.mean, "var": self.var, "count_limit": self.count_limit}

    @classmethod
    def from_dict(cls, d: dict) -> "RunningNormalizer":
        """Restore from `to_dict` output; rejects non-finite statistics."""
        n = cls(int(d["count"]), float(d["mean"]), float(d["var"]), int(d.get("count_limit", 3000)))
        if not (math.isfinite(n.mean) and math.isfinite(n.var)) or n.var < 0 or n.count < 0:
            raise ValueError(f"invalid normalizer state {d!r}")
        return n


# -- the state and the stateful half of a step -----------------------------------------------------
@dataclass
class ForwardResult:
    """What the stateless part gives for one step: raw values per model and diversity's embeddings.

    `results` holds one ScoreResult per active model-backed scorer without state (reward models,
    relevance, NSFW, task validator). `embeddings` holds, per stateful mask that needs a model
    (diversity), one (vector on CPU, status) per live completion. Nothing here depends on any state,
    so it can be computed for several clients' steps together, in any order, in any process.
    """

    step: Step
    results: dict[str, ScoreResult]
    embeddings: dict[str, list[Embedding]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    """When the forward pass began (the event's `step_length` runs from here to the commit)."""


def checked_score(name: str, request: ScoreRequest, fn: Any) -> ScoreResult:
    """Run one scorer (or its stateful half); a raise marks every live completion ERROR.

    A wrong number of scores is an error too, and a non-finite score with a scored status becomes
    ERROR with NaN: never a silent NaN, never a crash of the scoring loop.
    """
    n = len(request.completions)
    try:
        res = fn(request)
        if len(res.scores) != n:
            raise RuntimeError(f"returned {len(res.scores)} scores for {n} completions")
    except Exception:  # noqa: BLE001 - the scoring loop must not crash
        log.exception("%s failed; its completions are marked '%s'", name, Status.ERROR)
        return ScoreResult([math.nan] * n, [Status.FAILED if c is None else Status.ERROR for c in request.completions])
    for i, (x, st) in enumerate(zip(res.scores, res.statuses)):
        if st in Status.SCORED and not math.isfinite(x):
            # A model that produced NaN or inf did not score: say so, never a silent NaN.
            log.warning("%s gave a non-finite score (%r) for completion %d", name, x, i)
            res.statuses[i] = Status.ERROR
            res.scores[i] = math.nan
    return res


class RewardState:
    """The stateful part of the stack: what one validator (namespace) carries from step to step.

    Holds the reward models' running normalizers, the blacklist of the forward pass in progress,
    the diversity history, the number of committed steps (which is also the last committed
    sequence number: steps are numbered from 1) and the results of the last `RECENT_RESULTS`
    committed sequence numbers, for retried requests. Needs the config (weights, which masks are
    on), never a model: `apply` is arithmetic on the stateless part's output.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.normalizers = {name: RunningNormalizer() for name in REWARD_MODELS}
        self.blacklist = BlacklistState()
        self.diversity = DiversityHistory()
        self.steps_scored = 0
        self.recent: OrderedDict[int, str] = OrderedDict()
        """Sequence number -> the stored response of that step (JSON text), the last RECENT_RESULTS."""
        self.recent_bytes = 0
        """The UTF-8 size of `recent`."""
        self.dormant: dict[str, dict[str, Any]] = {}
        """Saved state of scorers switched off in this run: carried over untouched, not dropped."""
        self.session: dict[str, Any] = {}
        """The namespace's writer session (epoch, holder), which the service keeps with the state."""

    # -- sequence numbers -------------------------------------------------------------------
    @property
    def sequence(self) -> int:
        """The last committed sequence number (0 before the first step)."""
        return self.steps_scored

    def remember(self, sequence: int, response: str) -> None:
        """Keep the response of committed step `sequence` for retries: the oldest go beyond
        RECENT_RESULTS answers or RECENT_BYTES bytes (the newest is always kept)."""
        self.recent[sequence] = response
        self.recent_bytes += len(response.encode())
        while len(self.recent) > 1 and (len(self.recent) > RECENT_RESULTS or self.recent_bytes > RECENT_BYTES):
            _, dropped = self.recent.popitem(last=False)
            self.recent_bytes -= len(dropped.encode())

    # -- the stateful half of a step --------------------------------------------------------
    def _active(self, name: str) -> bool:
        return self.config.models[name].active

    def apply(self, fwd: ForwardResult) -> StepResult:
        """Normalize, mask and combine one step's raw values; update every piece of state."""
        step = fwd.step
        n = len(step.completions)
        if step.resolved()["new_forward_pass"]:
            self.blacklist.reset()
        base_prompt = step.base_prompt if step.base_prompt is not None else step.prompt
        raw: dict[str, list[float]] = {}
        normalized: dict[str, list[float]] = {}
        model_statuses: dict[str, list[str]] = {}
        rewards = [0.0] * n
        for name in REWARD_MODELS:
            weight = self.config.models[name].weight
            res = fwd.results.get(name)
            if res is None:
                raw[name] = [0.0] * n
                normalized[name] = [0.0] * n
                continue
            raw[name] = res.scores
            normalized[name] = self.normalizers[name](res.scores)
            model_statuses[name] = res.statuses
            rewards = [r + weight * x for r, x in zip(rewards, normalized[name])]
        for name in MASKS:
            request = ScoreRequest(base_prompt, step.completions, step.name)
            if name in fwd.results:
                res = fwd.results[name]
            elif name == BLACKLIST and self._active(name):
                res = checked_score(name, request, self.blacklist.score)
            elif name in fwd.embeddings:
                res = checked_score(name, request, lambda r, e=fwd.embeddings[name]: self.diversity.score(r, e))
            else:
                # A mask switched off logs zeros and is not applied.
                raw[name] = [0.0] * n
                normalized[name] = [0.0] * n
                continue
            # Masks are not normalized; a completion the mask could not judge counts as masked.
            mask = [x if math.isfinite(x) else 0.0 for x in res.scores]
            raw[name] = res.scores
            normalized[name] = mask
            model_statuses[name] = res.statuses
            rewards = [r * m for r, m in zip(rewards, mask)]
        statuses = [Status.FAILED if c is None else Status.worst([s[i] for s in model_statuses.values()])
                    for i, c in enumerate(step.completions)]
        best = ""
        if n:
            i_best = max(range(n), key=lambda i: (rewards[i], -i))  # first of the maxima, like argmax
            best = (step.completions[i_best] or "").strip()
        if self._active(BLACKLIST) and n:  # the reference records the best even when it is empty
            # Replaying a recorded run, the blacklist holds what the validator chose (its logged best).
            self.blacklist.record_best(step.name, step.logged_best if step.logged_best is not None else best)
        self.steps_scored += 1
        result = StepResult(rewards, best, raw, normalized, statuses, model_statuses, sequence=self.steps_scored)
        result.event = build_event(step, result, time.time() - fwd.started)
        return result

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Everything that must outlive the process, by section (the StateStore's layout)."""
        sections: dict[str, dict[str, Any]] = dict(self.dormant)
        stack: dict[str, Any] = {"steps_scored": self.steps_scored}
        if self.recent:
            stack["recent"] = {str(k): v for k, v in self.recent.items()}
        sections |= {"normalizers": {n: norm.to_dict() for n, norm in self.normalizers.items()}, "stack": stack}
        if self.session:
            sections["session"] = dict(self.session)
        for name, part in ((BLACKLIST, self.blacklist), (DIVERSITY, self.diversity)):
            if self._active(name):
                st = part.state_dict()
                if st:
                    sections[name] = st
        return sections

    def load_state_dict(self, sections: Mapping[str, dict[str, Any]]) -> None:
        """Restore what `state_dict` gave. Raises StateError when the sections are inconsistent."""
        self.dormant = {k: dict(v) for k, v in sections.items() if k in ALL_MODELS and not self._active(k)}
        try:
            for name, d in sections.get("normalizers", {}).items():
                if name in self.normalizers:
                    self.normalizers[name] = RunningNormalizer.from_dict(d)
            stack = sections.get("stack", {})
            self.steps_scored = int(stack.get("steps_scored", 0))
            self.recent = OrderedDict(sorted((int(k), str(v)) for k, v in dict(stack.get("recent", {})).items()))
            self.recent_bytes = sum(len(r.encode()) for r in self.recent.values())
            self.session = dict(sections.get("session", {}))
            if self._active(BLACKLIST) and BLACKLIST in sections:
                self.blacklist.load_state_dict(sections[BLACKLIST])
            if self._active(DIVERSITY) and DIVERSITY in sections:
                self.diversity.load_state_dict(sections[DIVERSITY])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateError(f"state is inconsistent: {e}") from e


def build_event(step: Step, result: StepResult, elapsed: float) -> dict[str, Any]:
    """The event dict of one scored step, with the spec's field names."""
    filled = step.resolved()
    event: dict[str, Any] = {
        "name": step.name,
        "block": step.block,
        "gating_loss": step.gating_loss,
        "uids": filled["uids"],
        "prompt": step.prompt,
        # the masks' base prompt as scored (the prompt when the step gave none): replaying this
        # event then uses it rather than rebuilding one from the previous best (docs/SEMANTICS.md)
        "base_prompt": filled["base_prompt"],
        "step_length": elapsed,
        "best": result.best,
        "completions": [c if c is not None else "" for c in step.completions],
        "completion_times": filled["completion_times"],
        "rewards": result.rewards,
        "set_weights": step.set_weights,
    }
    for name in ALL_MODELS:
        event[name] = result.raw[name]
        event[name + "_normalized"] = result.normalized[name]
    event["statuses"] = result.statuses
    event["model_statuses"] = result.model_statuses
    return event


state_log = logging.getLogger("rewardstack.state")

STATE_FILE = "state.safetensors"
LOCK_FILE = "lock"
_JSON_KEY = "rewardstack_json"
"""The JSON document: a metadata key up to format 2, a uint8 tensor of the body from format 3."""
_VERSION_KEY = "rewardstack_format"
FORMAT_VERSION = 3


class StateLockedError(StateError):
    """Another process holds the state directory's lock."""


class StateStore:
    """Reads and writes `{section: {key: tensor | JSON value}}` to `<state_dir>/state.safetensors`."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.loaded_version: int | None = None
        """The format version of the file last loaded (None: nothing loaded yet, or no file)."""

    def save(self, sections: dict[str, dict[str, Any]]) -> None:
        """Atomically replace the stored state with `sections` (in the current format)."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict[str, dict[str, Any]] = {}
        for section, values in sections.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{section}/{key}"] = value.detach().to("cpu").contiguous()
                else:
                    plain.setdefault(section, {})[key] = value
        doc = json.dumps({"version": FORMAT_VERSION, "sections": plain}, allow_nan=False, ensure_ascii=False)
        tensors[_JSON_KEY] = torch.frombuffer(bytearray(doc.encode("utf-8")), dtype=torch.uint8)
        data = save(tensors, metadata={_VERSION_KEY: str(FORMAT_VERSION)})
        self._keep_older_format()
        atomic_write_bytes(self.path, data, mode=0o600)  # private, as before
        self.loaded_version = FORMAT_VERSION
        state_log.debug("state saved to %s: %d bytes (%d of JSON)", self.path, len(data), len(doc))

    def _keep_older_format(self) -> None:
        """Before the first save over a migrated file, keep the original beside it."""
        old = self.loaded_version
        if old is None or old >= FORMAT_VERSION or not self.path.exists():
            return
        backup = self.dir / f"state.v{old}.safetensors"
        if not backup.exists():
            shutil.copy2(self.path, backup)
            fsync_dir(self.dir)
            state_log.warning("state in %s migrated from format %d to %d; the original is kept as %s",
                        self.dir, old, FORMAT_VERSION, backup.name)

    def load(self) -> dict[str, dict[str, Any]]:
        """The stored sections ({} when nothing was saved yet), migrated to the current format.

        Raises StateError if the file is unreadable or was written by a newer rewardstack.
        """
        for tmp in self.dir.glob(f".{STATE_FILE}.*.tmp"):  # a killed save's (one writer per state dir: `StateLock`)
            tmp.unlink(missing_ok=True)
        if not self.path.exists():
            return {}
        try:
            tensors = load_file(self.path)
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                meta = f.metadata() or {}
            body = tensors.pop(_JSON_KEY, None)
            doc = json.loads(body.numpy().tobytes().decode("utf-8") if body is not None else meta.get(_JSON_KEY, "{}"))
        except (SafetensorError, OSError, ValueError) as e:
            raise StateError(f"cannot read state file {self.path}: {e}") from e
        version = doc.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise StateError(f"state file {self.path} has an invalid format version {version!r}")
        if version > FORMAT_VERSION:
            raise StateError(
                f"state file {self.path} was written by a newer rewardstack (state format {version}; this "
                f"version reads formats up to {FORMAT_VERSION}). Upgrade rewardstack or set another state_dir; "
                "the file was not changed."
            )
        sections: dict[str, dict[str, Any]] = {s: dict(v) for s, v in doc.get("sections", {}).items()}
        for name, t in tensors.items():
            section, _, key = name.partition("/")
            sections.setdefault(section, {})[key] = t
        # Formats 1 and 2 hold the sections of format 3 (which moved the JSON into the body, read
        # above): nothing to convert; the first save writes format 3 and keeps the original.
        self.loaded_version = version
        return sections


class StateLock:
    """An exclusive lock on a folder (`filelock`'s `flock` on `<dir>/lock`), held until `release`.

    Only one process may write a state directory at a time: a second `acquire` (from another
    process, or another `StateLock` in this one) raises `StateLockedError` at once, naming the pid
    that holds it; with `wait`, it waits instead (a short critical section, as the namespace limit's).
    The kernel drops the lock when its holder dies, so a killed run never leaves a stale lock behind.
    Any thread may release it (the service releases at shutdown what its worker thread took).
    """

    def __init__(self, state_dir: str | Path, *, name: str = LOCK_FILE, wait: bool = False) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / name  # another file name: the same lock on another kind of folder
        self._lock = FileLock(self.path, timeout=-1 if wait else 0, thread_local=False)

    def acquire(self) -> "StateLock":
        """Take the lock or raise StateLockedError."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            try:
                holder = self.path.read_text(encoding="ascii", errors="replace").strip()
            except OSError:
                holder = ""
            who = f"process {holder}" if holder else "another process"
            raise StateLockedError(
                f"state directory {self.dir} is in use by {who} (lock {self.path}); only one process may "
                "write a state directory at a time: wait for it to finish or use another state_dir"
            ) from None
        except OSError as e:
            raise StateError(f"cannot lock state directory {self.dir}: {e}") from e
        self.path.write_text(f"{os.getpid()}\n", encoding="ascii")  # another open file: the lock stays
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        self._lock.release(force=True)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def __enter__(self) -> "StateLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
