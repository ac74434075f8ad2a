"""The reward stack: composes scorers and masks, normalizes, combines, persists and builds events.

`RewardStack.score_step` is the whole validator step: every active reward model scores the step's
prompt and completions, each is normalized by its running normalizer, combined with the configured
weights, multiplied by every active mask (which see the base prompt), and turned into the event dict
with the spec's field names. Nothing here touches tensors: scorers and the memory layer do.

The step is two parts, usable apart (the HTTP service batches the first over several clients and
keeps one second part per client; the Ray scale-out runs them in different processes):

- the stateless part, `RewardStack.forward(step) -> ForwardResult`: every forward pass (the reward
  models, the masks without state, diversity's embeddings); text in, raw values and embeddings out;
- the stateful part, `RewardState.apply(forward) -> StepResult`: normalizers, the blacklist, the
  diversity history and the committed sequence number; raw values in, rewards and event out.

`score_step(step) == state.apply(forward(step))`, then the state is saved.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rewardstack.config import ALL_MODELS, MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import InputError, SequenceError, StateError
from rewardstack.memory import MemoryManager, configure_allocator, maybe_empty_cache
from rewardstack.memory.manager import check_device
from rewardstack.memory.snapshot import take_snapshot
from rewardstack import models
from rewardstack.normalize import RunningNormalizer
from rewardstack.oplog import OperatorLog, log_models
from rewardstack.scorers import build_scorer
from rewardstack.scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack.scorers.embedding import DiversityHistory, Embedding
from rewardstack.scorers.rules import BlacklistState
from rewardstack.scorers.loading import ModelCache
from rewardstack.state import StateStore
from rewardstack.stepobservers import StepObserver, StepReport, step_record
from rewardstack.stepresult import StepResult

log = logging.getLogger("rewardstack.stack")


@dataclass
class Step:
    """One validator step. `completions[i] is None` marks a failed response (not scored)."""

    name: str
    prompt: str
    completions: list[str | None]
    base_prompt: str | None = None
    uids: list[int] | None = None
    completion_times: list[float] | None = None
    block: int | None = None
    gating_loss: float | None = None
    set_weights: Any = None
    new_forward_pass: bool | None = None
    """Whether this step opens a validator forward pass (default: the `augment` step does)."""
    logged_best: str | None = None
    """The `best` a recorded run logged for this step (replay): the blacklist records it instead of the stack's own best."""

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form `rewardstack score` reads (fields left unset are left out)."""
        d: dict[str, Any] = {"name": self.name, "prompt": self.prompt, "completions": list(self.completions)}
        for key in ("base_prompt", "uids", "completion_times", "block", "gating_loss", "set_weights", "new_forward_pass", "logged_best"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, line: int | None = None) -> "Step":
        """Validate a JSON object into a Step; errors name the line and field."""
        if not isinstance(d, Mapping):
            raise InputError("a step must be a JSON object", line=line)
        for key in ("name", "prompt", "completions"):
            if key not in d:
                raise InputError("missing", line=line, field=key)
        for key in ("name", "prompt"):
            if not isinstance(d[key], str):
                raise InputError(f"must be a string, got {type(d[key]).__name__}", line=line, field=key)
        if not TASK_RE.fullmatch(d["name"]):
            raise InputError(f"must be augment, followupN or answerN, got {d['name'][:40]!r}", line=line, field="name")
        comps = d["completions"]
        if not isinstance(comps, list) or not all(c is None or isinstance(c, str) for c in comps):
            raise InputError("must be a list of strings (null marks a failed response)", line=line, field="completions")
        base = d.get("base_prompt")
        if base is not None and not isinstance(base, str):
            raise InputError("must be a string", line=line, field="base_prompt")
        uids = d.get("uids")
        if uids is not None:
            if not isinstance(uids, list) or not all(isinstance(u, int) and not isinstance(u, bool) for u in uids):
                raise InputError("must be a list of integers", line=line, field="uids")
            if len(uids) != len(comps):
                raise InputError(f"has {len(uids)} entries for {len(comps)} completions", line=line, field="uids")
        times = d.get("completion_times")
        if times is not None:
            if not isinstance(times, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
                raise InputError("must be a list of numbers", line=line, field="completion_times")
            if len(times) != len(comps):
                raise InputError(f"has {len(times)} entries for {len(comps)} completions", line=line, field="completion_times")
        failed = d.get("failed")
        if failed is not None:
            if not isinstance(failed, list) or len(failed) != len(comps) or not all(isinstance(f, bool) for f in failed):
                raise InputError("must be a list of booleans, one per completion", line=line, field="failed")
            comps = [None if f else c for c, f in zip(comps, failed)]
        nfp = d.get("new_forward_pass")
        if nfp is not None and not isinstance(nfp, bool):
            raise InputError("must be true or false", line=line, field="new_forward_pass")
        block = d.get("block")
        if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 0):
            raise InputError("must be a non-negative integer", line=line, field="block")
        gating_loss = d.get("gating_loss")
        if gating_loss is not None and (not isinstance(gating_loss, (int, float)) or isinstance(gating_loss, bool)):
            raise InputError("must be a number", line=line, field="gating_loss")
        set_weights = d.get("set_weights")
        if not _valid_weights(set_weights):
            raise InputError("must be a number, a boolean, or a list (of lists) of numbers", line=line, field="set_weights")
        logged_best = d.get("logged_best")
        if logged_best is not None and not isinstance(logged_best, str):
            raise InputError("must be a string", line=line, field="logged_best")
        for key, value in [("prompt", d["prompt"]), ("base_prompt", base)] + [(f"completions[{i}]", c) for i, c in enumerate(comps)]:
            if isinstance(value, str) and not _is_valid_unicode(value):
                raise InputError("is not valid Unicode (it holds a lone surrogate)", line=line, field=key)
        # Completions arrive stripped in the validator; strip here so every scorer agrees.
        comps = [c.strip() if isinstance(c, str) else None for c in comps]
        return cls(
            name=d["name"], prompt=d["prompt"], completions=comps, base_prompt=base,
            uids=list(uids) if uids is not None else None,
            completion_times=[float(t) for t in times] if times is not None else None,
            block=block, gating_loss=gating_loss, set_weights=set_weights,
            new_forward_pass=nfp, logged_best=logged_best.strip() if logged_best is not None else None,
        )


TASK_RE = re.compile(r"augment|followup[0-9]*|answer[0-9]*")
"""The task names a step may have (spec: `augment`, `followupN`, `answerN`; replay's v1.0 rows: no N)."""


def _valid_weights(value: Any, depth: int = 0) -> bool:
    """`set_weights` as the validator logs it: null, a number or boolean, or lists of those (2 levels)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, list) and depth < 2:
        return all(_valid_weights(v, depth + 1) for v in value)
    return False


def check_completions(step: Step, limit: int, *, line: int | None = None) -> None:
    """InputError naming `completions` when `step` has more than `limit` (`[input] max_completions`)."""
    if len(step.completions) > limit:
        raise InputError(f"{len(step.completions)} completions, more than {limit} ([input] max_completions)",
                         line=line, field="completions")


@dataclass
class ReadView:
    """What the models read of a step: every text cut to `[input] max_chars`, and what was cut."""

    step: Step
    prompt_cut: bool
    base_cut: bool
    cut: list[bool]
    """Per completion: whether its text was cut."""

    @classmethod
    def of(cls, step: Step, max_chars: int) -> "ReadView":
        def cut(text: str | None) -> tuple[str | None, bool]:
            if text is None or len(text) <= max_chars:
                return text, False
            return text[:max_chars], True

        prompt, p_cut = cut(step.prompt)
        base, b_cut = cut(step.base_prompt)
        comps = [cut(c) for c in step.completions]
        if not (p_cut or b_cut or any(c for _, c in comps)):
            return cls(step, False, False, [False] * len(comps))
        view = dataclasses.replace(step, prompt=prompt, base_prompt=base, completions=[t for t, _ in comps])
        return cls(view, p_cut, b_cut if step.base_prompt is not None else p_cut, [c for _, c in comps])

    def mark(self, res: ScoreResult, *, mask: bool) -> ScoreResult:
        """`res` with every scored completion whose input (text or prompt) was cut marked CUT."""
        whole = self.base_cut if mask else self.prompt_cut
        for i, c in enumerate(self.cut):
            if (c or whole) and res.statuses[i] in Status.SCORED:
                res.statuses[i] = Status.CUT
        return res

    def mark_embeddings(self, embs: list[Embedding]) -> list[Embedding]:
        """Diversity's (vector, status) per live completion, CUT where that completion was cut."""
        live = [i for i, c in enumerate(self.step.completions) if c is not None]
        return [(v, Status.CUT if (self.cut[i] or self.base_cut) and st in Status.SCORED else st)
                for i, (v, st) in zip(live, embs)]


def _is_valid_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (lone surrogates such as \\ud800)."""
    if text.isascii():  # no copy of a huge ASCII text just to check it
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


BLACKLIST = models.BLACKLIST.name
DIVERSITY = models.DIVERSITY.name
RECENT_RESULTS = 64
"""How many committed results a state keeps for retried requests (by sequence number)."""
RECENT_BYTES = 64 * 2**20
"""At most this many bytes of kept results (UTF-8): a state holds 64 small answers, or fewer large
ones (the newest always), so what it keeps of texts is bounded whatever the steps hold."""


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


def _checked(name: str, request: ScoreRequest, fn: Any) -> ScoreResult:
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


def opens_forward_pass(step: Step) -> bool:
    """Whether `step` opens a validator forward pass (explicitly, or by being the `augment` step)."""
    return step.new_forward_pass if step.new_forward_pass is not None else step.name == "augment"


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
        self.recent_bytes: int | None = 0
        """The UTF-8 size of `recent` (None: not counted since a load)."""
        self.dormant: dict[str, dict[str, Any]] = {}
        """Saved state of scorers switched off in this run: carried over untouched, not dropped."""

    # -- sequence numbers -------------------------------------------------------------------
    @property
    def sequence(self) -> int:
        """The last committed sequence number (0 before the first step)."""
        return self.steps_scored

    def check_sequence(self, sequence: int | None) -> str | None:
        """None when `sequence` (or no sequence) is the next step; the stored result of a repeat.

        Raises SequenceError naming the expected number for a gap, or for a repeat whose result is
        no longer kept (older than the last RECENT_RESULTS, or pushed out by RECENT_BYTES).
        """
        if sequence is None or sequence == self.steps_scored + 1:
            return None
        stored = self.recent.get(sequence)
        if stored is not None:
            return stored
        raise SequenceError(sequence, self.steps_scored + 1)

    def remember(self, sequence: int, response: str) -> None:
        """Keep the response of committed step `sequence` for retries: the oldest go beyond
        RECENT_RESULTS answers or RECENT_BYTES bytes (the newest is always kept)."""
        self.recent[sequence] = response
        self.recent_bytes = self.recent_bytes + len(response.encode()) if self.recent_bytes is not None else None
        if self.recent_bytes is None:  # a state just loaded: counted once
            self.recent_bytes = sum(len(r.encode()) for r in self.recent.values())
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
        if opens_forward_pass(step):
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
                res = _checked(name, request, self.blacklist.score)
            elif name in fwd.embeddings:
                res = _checked(name, request, lambda r, e=fwd.embeddings[name]: self.diversity.score(r, e))
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
        statuses = [
            Status.worst([s[i] for s in model_statuses.values()]) if model_statuses else
            (Status.FAILED if step.completions[i] is None else Status.OK)
            for i in range(n)
        ]
        for i, c in enumerate(step.completions):
            if c is None:
                statuses[i] = Status.FAILED
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
            self.recent_bytes = None
            if self._active(BLACKLIST) and BLACKLIST in sections:
                self.blacklist.load_state_dict(sections[BLACKLIST])
            if self._active(DIVERSITY) and DIVERSITY in sections:
                self.diversity.load_state_dict(sections[DIVERSITY])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateError(f"state is inconsistent: {e}") from e


def build_event(step: Step, result: StepResult, elapsed: float) -> dict[str, Any]:
    """The event dict of one scored step, with the spec's field names."""
    n = len(step.completions)
    event: dict[str, Any] = {
        "name": step.name,
        "block": step.block,
        "gating_loss": step.gating_loss,
        "uids": step.uids if step.uids is not None else list(range(n)),
        "prompt": step.prompt,
        # the masks' base prompt as scored (the prompt when the step gave none): replaying this
        # event then uses it rather than rebuilding one from the previous best (docs/SEMANTICS.md)
        "base_prompt": step.base_prompt if step.base_prompt is not None else step.prompt,
        "step_length": elapsed,
        "best": result.best,
        "completions": [c if c is not None else "" for c in step.completions],
        "completion_times": step.completion_times if step.completion_times is not None else [0.0] * n,
        "rewards": result.rewards,
        "set_weights": step.set_weights,
    }
    for name in ALL_MODELS:
        event[name] = result.raw[name]
        event[name + "_normalized"] = result.normalized[name]
    event["statuses"] = result.statuses
    event["model_statuses"] = result.model_statuses
    return event


class RewardStack:
    """A configured set of reward models and masks with their persistent state."""

    def __init__(self, config: StackConfig, *, memory: MemoryManager | None = None, load_state: bool = True,
                 recalibrate: bool = False) -> None:
        from rewardstack.quiet import silence_moot_warnings

        silence_moot_warnings()  # e.g. transformers' "longer than the maximum": the scorers cut inputs themselves
        self.config = config
        self.device = check_device(config.device)  # one line naming device and torch build, before anything loads
        if self.device.type == "cuda":
            configure_allocator()  # must precede the first CUDA allocation
        own_memory = memory is None
        # Reads the card's free memory before any model loads; finds the calibration cache.
        self.memory = memory if memory is not None else MemoryManager.for_config(config, recalibrate=recalibrate)
        self.models = ModelCache(self.device)  # loads on the host: placement moves what stays resident
        self.runtime = Runtime(device=self.device, memory=self.memory, models=self.models)
        self.scorers: dict[str, Scorer] = {}
        from rewardstack.quiet import no_progress_bars

        with self.memory.deferred_calibration(), no_progress_bars():  # place, then load onto the card, then profile
            for cfg in config.active_models():
                log.info("building %s", cfg.name)
                self.memory.describe_model(cfg)
                self.scorers[cfg.name] = build_scorer(cfg, self.runtime)
        for name, scorer in self.scorers.items():
            modules = scorer.modules()
            if modules:
                # Filters are small: placement may keep them on CPU when the card is short.
                self.memory.register_model(name, modules, cpu_ok=scorer.kind == "mask")
        if own_memory:
            # Budget = card x utilization - weights - headroom (or memory_budget), then placement
            # decides from the weights' exact sizes what stays resident and moves only that.
            self.memory.setup(config)
        self.memory.run_calibrations()  # each model profiled where it runs, or read from the cache
        log_models(self)  # per model: checkpoint, revision, dtype, weights bytes, device
        self.state = RewardState(config)
        """The stateful part (this stack's own; the service keeps one per namespace)."""
        self.store = StateStore(config.state_dir)
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        """Called after each scored step with the step's memory record (docs/TELEMETRY.md)."""
        self.step_observers: list[StepObserver] = [OperatorLog()]
        """Subscribers of every step (`rewardstack.stepobservers`): the operator's log line, telemetry."""
        if load_state:
            self.load_state()

    @classmethod
    def from_config(cls, path: str, **kwargs: Any) -> "RewardStack":
        """Build a stack from a TOML config file."""
        from rewardstack.config import load_config

        return cls(load_config(path), **kwargs)

    # -- state ------------------------------------------------------------------------------
    @property
    def normalizers(self) -> dict[str, RunningNormalizer]:
        """The running normalizers of this stack's state."""
        return self.state.normalizers

    @property
    def steps_scored(self) -> int:
        """Steps committed to this stack's state (also its last sequence number)."""
        return self.state.steps_scored

    @steps_scored.setter
    def steps_scored(self, value: int) -> None:
        self.state.steps_scored = value

    def new_state(self) -> RewardState:
        """A fresh stateful part for this stack's config (one per client in the service)."""
        return RewardState(self.config)

    def state_sections(self) -> dict[str, dict[str, Any]]:
        """Everything that must outlive the process, by section."""
        return self.state.state_dict()

    def save_state(self) -> None:
        """Atomically persist normalizers and scorer state to the state directory."""
        self.store.save(self.state_sections())

    def load_state(self) -> None:
        """Restore persisted state, if any."""
        sections = self.store.load()
        try:
            self.state.load_state_dict(sections)
        except StateError as e:
            raise StateError(f"state in {self.store.path} is inconsistent: {e}") from e
        if sections:
            log.info("restored state from %s (%d steps scored before)", self.store.path, self.steps_scored)

    # -- scoring ----------------------------------------------------------------------------
    def score_step(self, step: Step | Mapping[str, Any], *, save: bool = True) -> StepResult:
        """Score one validator step and return rewards, per-model scores, statuses and the event."""
        if isinstance(step, Step):
            check_completions(step, self.config.input.max_completions)
        name = step.name if isinstance(step, Step) else str(step.get("name", "?"))
        observers = list(self.step_observers)
        for o in observers:  # the operator's INFO line: time, statuses, memory peak
            o.step_started(self, name)
        try:
            result = self.state.apply(self.forward(step))
        finally:
            for o in reversed(observers):  # windows close innermost first
                o.step_ended(self)
        for o in observers:
            o.step_scored(self, result)
        if save:
            self.save_state()
        self.publish_step(result)  # telemetry, a validator's own logging (wandb): docs/TELEMETRY.md
        return result

    def publish_step(self, result: StepResult, *, record: bool = False) -> dict[str, Any] | None:
        """Build the step's memory record and hand it to the observers that want it, then to `on_step`.

        Nothing is built when no one listens (None) unless `record` asks for it. The service calls
        this for each step it commits, with `record`: its answer carries the record's summary.
        """
        observers = [o for o in self.step_observers if o.wants_records]
        if not observers and not self.on_step and not record:
            return None
        snap = take_snapshot(self.memory.device, self.memory.tracker)
        report = StepReport(self, result, step_record(self, result, snap), snap)
        for o in observers:  # the telemetry monitor fills in what it measured: later callbacks see it
            o.step_done(report)
        for callback in list(self.on_step):
            callback(report.record)
        return report.record

    def forward(self, step: Step | Mapping[str, Any]) -> ForwardResult:
        """The stateless part of a step: every forward pass, no state read or written.

        Reward models score the prompt, masks the base prompt; the blacklist needs no model (it
        runs in `RewardState.apply`) and diversity gives its embeddings only.
        """
        return self.forward_many([step])[0]

    def forward_many(self, steps: Sequence[Step | Mapping[str, Any]]) -> list[ForwardResult]:
        """The stateless part of several steps, model by model (each model's weights used once).

        Each step is still its own scorer call, so every step's values are those `forward` gives
        it alone; the order only saves swapping weights in and out between steps.
        """
        parsed = [s if isinstance(s, Step) else Step.from_dict(s) for s in steps]
        # The models read each text up to `[input] max_chars` characters (bounded work per input);
        # a completion whose text or prompt was cut gets status CUT. The rest is never read: the
        # blacklist, `best` and the event see the step as read, so a 50 MB completion is not
        # copied into the event line, the state's journal or a stored service answer either.
        views = [ReadView.of(step, self.config.input.max_chars) for step in parsed]
        started = time.time()
        results: list[dict[str, ScoreResult]] = [{} for _ in parsed]
        embeddings: list[dict[str, list[Embedding]]] = [{} for _ in parsed]
        # The models in the order they run: while one runs, its successor is prefetched (a swapped
        # model's weights copied on the side stream, CUDA only), so the copy overlaps the passes.
        order = [n for n in (*REWARD_MODELS, *MASKS) if n in self.scorers and self.scorers[n].modules()]
        upcoming = dict(zip(order, order[1:]))
        for name in REWARD_MODELS:
            if name in self.scorers:
                self.memory.up_next = upcoming.get(name)
                for view, res in zip(views, results):
                    step = view.step
                    res[name] = view.mark(self.run_scorer(name, ScoreRequest(step.prompt, step.completions, step.name)), mask=False)
        for name in MASKS:
            scorer = self.scorers.get(name)
            if scorer is None:
                continue
            self.memory.up_next = upcoming.get(name)
            for view, res, emb in zip(views, results, embeddings):
                step = view.step
                base_prompt = step.base_prompt if step.base_prompt is not None else step.prompt
                request = ScoreRequest(base_prompt, step.completions, step.name)
                if not scorer.stateful:
                    res[name] = view.mark(self.run_scorer(name, request), mask=True)
                    continue
                part = self.run_stateless_part(name, request)  # the state's half runs in `RewardState.apply`
                if part is not None:
                    emb[name] = view.mark_embeddings(part)
        self.memory.up_next = None  # a pass outside the step (a profile) prefetches nothing
        if self.device.type == "cuda":
            maybe_empty_cache(self.device)  # only when measured fragmentation crosses the threshold
        # The step as read goes on (blacklist, best, event): nothing past max_chars is kept or echoed.
        return [ForwardResult(view.step, res, emb, started) for view, res, emb in zip(views, results, embeddings)]

    def run_scorer(self, name: str, request: ScoreRequest) -> ScoreResult:
        """One scorer on one request; a scorer that raises marks every live completion ERROR."""
        return _checked(name, request, self.scorers[name].score)

    def run_stateless_part(self, name: str, request: ScoreRequest) -> list[Embedding] | None:
        """A stateful mask's forward pass (`Scorer.stateless_part`: diversity's embeddings, None for
        the blacklist); one that raises gives ERROR for every live completion."""
        try:
            return self.scorers[name].stateless_part(request)
        except Exception:  # noqa: BLE001 - the scoring loop must not crash
            log.exception("%s failed; its completions are marked '%s'", name, Status.ERROR)
            return [(None, Status.ERROR)] * len(request.live())
