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

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from rewardstack.config import ALL_MODELS, MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import StateError
from rewardstack._memory import MemoryManager, configure_allocator, maybe_empty_cache
from rewardstack._memory.manager import check_device
from rewardstack._memory.device import take_snapshot
from rewardstack import _models as models
from rewardstack._normalize import RunningNormalizer
from rewardstack._oplog import OperatorLog, log_models
from rewardstack._readview import ReadView
from rewardstack._scorers import build_scorer
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.embedding import DiversityHistory, Embedding
from rewardstack._scorers.rules import BlacklistState
from rewardstack._scorers.loading import ModelCache
from rewardstack._state import StateStore
from rewardstack._stepobservers import StepObserver, StepReport, step_record
from rewardstack._stepresult import StepResult
from rewardstack._wire import RECENT_BYTES, RECENT_RESULTS, Step, check_completions

log = logging.getLogger("rewardstack.stack")


BLACKLIST = models.BLACKLIST.name
DIVERSITY = models.DIVERSITY.name


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
            self.recent_bytes = None
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


class RewardStack:
    """A configured set of reward models and masks with their persistent state."""

    def __init__(self, config: StackConfig, *, memory: MemoryManager | None = None, load_state: bool = True,
                 recalibrate: bool = False) -> None:
        from rewardstack._quiet import silence_moot_warnings

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
        from rewardstack._quiet import no_progress_bars

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
        """Subscribers of every step (`rewardstack._stepobservers`): the operator's log line, telemetry."""
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
        for name in REWARD_MODELS:
            if name in self.scorers:
                for view, res in zip(views, results):
                    step = view.step
                    request = ScoreRequest(step.prompt, step.completions, step.name)
                    res[name] = view.mark(self.run_scorer(name, request), mask=False)
        for name in MASKS:
            scorer = self.scorers.get(name)
            if scorer is None:
                continue
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
        if self.device.type == "cuda":
            maybe_empty_cache(self.device)  # only when measured fragmentation crosses the threshold
        # The step as read goes on (blacklist, best, event): nothing past max_chars is kept or echoed.
        return [ForwardResult(view.step, res, emb, started) for view, res, emb in zip(views, results, embeddings)]

    def run_scorer(self, name: str, request: ScoreRequest) -> ScoreResult:
        """One scorer on one request; a scorer that raises marks every live completion ERROR. No
        profile runs inside it (`MemoryManager.serving`)."""
        with self.memory.serving():
            return _checked(name, request, self.scorers[name].score)

    def run_stateless_part(self, name: str, request: ScoreRequest) -> list[Embedding] | None:
        """A stateful mask's forward pass (`Scorer.stateless_part`: diversity's embeddings, None for
        the blacklist); one that raises gives ERROR for every live completion."""
        try:
            with self.memory.serving():
                return self.scorers[name].stateless_part(request)
        except Exception:  # noqa: BLE001 - the scoring loop must not crash
            log.exception("%s failed; its completions are marked '%s'", name, Status.ERROR)
            return [(None, Status.ERROR)] * len(request.live())
