"""The reward stack: composes scorers and masks, normalizes, combines, persists and builds events.

`RewardStack.score_step` is the whole validator step: every active reward model scores the step's
prompt and completions, each is normalized by its running normalizer, combined with the configured
weights, multiplied by every active mask (which see the base prompt), and turned into the event dict
with the spec's field names. Nothing here touches tensors: scorers and the memory layer do.

The step is two parts, usable apart (the HTTP service batches the first over several clients and
keeps one second part per client; the Ray scale-out runs them in different processes):

- the stateless part, `RewardStack.forward(step) -> ForwardResult`: every forward pass (the reward
  models, the masks without state, diversity's embeddings); text in, raw values and embeddings out;
- the stateful part, `RewardState.apply(forward) -> StepResult` (rewardstack._state):
  normalizers, the blacklist, the diversity history and the committed sequence number; raw values
  in, rewards and event out.

`score_step(step) == state.apply(forward(step))`, then the state is saved.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

from rewardstack.config import MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import StateError
from rewardstack._memory import MemoryManager, configure_allocator, maybe_empty_cache
from rewardstack._memory.manager import check_device
from rewardstack._memory.device import take_snapshot
from rewardstack._state import ForwardResult, RewardState, RunningNormalizer, StateStore, checked_score
from rewardstack._scorers import build_scorer
from rewardstack._scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack._scorers.embedding import Embedding
from rewardstack._scorers.loading import ModelCache
from rewardstack._stepobservers import OperatorLog, StepObserver, StepReport, StepResult, log_models, step_record
from rewardstack._wire import Step, check_completions

log = logging.getLogger("rewardstack.stack")


class RewardStack:
    """A configured set of reward models and masks with their persistent state."""

    def __init__(self, config: StackConfig, *, memory: MemoryManager | None = None, load_state: bool = True,
                 recalibrate: bool = False, models: ModelCache | None = None) -> None:
        from rewardstack._quiet import silence_moot_warnings

        silence_moot_warnings()  # e.g. transformers' "longer than the maximum": the scorers cut inputs themselves
        self.config = config
        self.device = check_device(config.device)  # one line naming device and torch build, before anything loads
        if self.device.type == "cuda":
            configure_allocator()  # must precede the first CUDA allocation
        own_memory = memory is None
        # Reads the card's free memory before any model loads; finds the calibration cache.
        self.memory = memory if memory is not None else MemoryManager.for_config(config, recalibrate=recalibrate)
        # Loads on the host (placement moves what stays resident); `models`: one holding models built
        # elsewhere (`ModelCache.adopt`).
        self.models = models if models is not None else ModelCache(self.device)
        self.runtime = Runtime(device=self.device, memory=self.memory, models=self.models)
        self.scorers: dict[str, Scorer] = {}
        from rewardstack._quiet import no_progress_bars

        with self.memory.deferred_calibration(), no_progress_bars():  # place, then load onto the card, then profile
            active = config.active_models()
            for i, cfg in enumerate(active, 1):
                log.info("loading %s (%d of %d): %s", cfg.name, i, len(active), cfg.path or ", ".join(cfg.paths) or "rules")
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

    def new_state(self) -> RewardState:
        """A fresh stateful part for this stack's config (one per client in the service)."""
        return RewardState(self.config)

    def save_state(self) -> None:
        """Atomically persist normalizers and scorer state to the state directory."""
        self.store.save(self.state.state_dict())

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
        limit = self.config.input.max_chars
        views = [step.as_read(limit) for step in parsed]
        started = time.time()
        results: list[dict[str, ScoreResult]] = [{} for _ in parsed]
        embeddings: list[dict[str, list[Embedding]]] = [{} for _ in parsed]
        order = [n for n in (*REWARD_MODELS, *MASKS) if n in self.scorers]
        up_next = dict(zip(order, order[1:]))  # a swapped model's copy starts beside the pass before it
        for name in REWARD_MODELS:
            if name in self.scorers:
                self.memory.expect(up_next.get(name))
                for sent, view, res in zip(parsed, views, results):
                    request = ScoreRequest(view.prompt, view.completions, view.name)
                    res[name] = _mark_cut(self.run_scorer(name, request), _cut(sent, limit, mask=False))
        for name in MASKS:
            scorer = self.scorers.get(name)
            if scorer is None:
                continue
            self.memory.expect(up_next.get(name))
            for sent, view, res, emb in zip(parsed, views, results, embeddings):
                request = ScoreRequest(view.resolved()["base_prompt"], view.completions, view.name)
                cut = _cut(sent, limit, mask=True)
                if not scorer.stateful:
                    res[name] = _mark_cut(self.run_scorer(name, request), cut)
                    continue
                part = self.run_stateless_part(name, request)  # the state's half runs in `RewardState.apply`
                if part is not None:  # diversity's (vector, status) per live completion
                    live = [i for i, c in enumerate(view.completions) if c is not None]
                    emb[name] = [(v, Status.CUT if cut[i] and st in Status.SCORED else st) for i, (v, st) in zip(live, part)]
        if self.device.type == "cuda":
            maybe_empty_cache(self.device)  # only when measured fragmentation crosses the threshold
        # The step as read goes on (blacklist, best, event): nothing past max_chars is kept or echoed.
        return [ForwardResult(view, res, emb, started) for view, res, emb in zip(views, results, embeddings)]

    def run_scorer(self, name: str, request: ScoreRequest) -> ScoreResult:
        """One scorer on one request; a scorer that raises marks every live completion ERROR. No
        profile runs inside it (`MemoryManager.serving`)."""
        with self.memory.serving():
            return checked_score(name, request, self.scorers[name].score)

    def run_stateless_part(self, name: str, request: ScoreRequest) -> list[Embedding] | None:
        """A stateful mask's forward pass (`Scorer.stateless_part`: diversity's embeddings, None for
        the blacklist); one that raises gives ERROR for every live completion."""
        try:
            with self.memory.serving():
                return self.scorers[name].stateless_part(request)
        except Exception:  # noqa: BLE001 - the scoring loop must not crash
            log.exception("%s failed; its completions are marked '%s'", name, Status.ERROR)
            return [(None, Status.ERROR)] * len(request.live())


def _cut(step: Step, limit: int, *, mask: bool) -> list[bool]:
    """Per completion of `step` as sent: whether a model read it cut at `limit`, its text or the
    prompt it is read with (a mask's is the base prompt)."""
    def long(text: str | None) -> bool:
        return text is not None and len(text) > limit

    whole = long(step.resolved()["base_prompt"] if mask else step.prompt)
    return [whole or long(c) for c in step.completions]


def _mark_cut(res: ScoreResult, cut: list[bool]) -> ScoreResult:
    """`res` with every scored completion that was read cut marked CUT."""
    for i, c in enumerate(cut):
        if c and res.statuses[i] in Status.SCORED:
            res.statuses[i] = Status.CUT
    return res


__all__ = ["ForwardResult", "RewardStack", "RewardState", "Step", "StepResult"]
