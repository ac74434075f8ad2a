"""The reward stack: composes scorers and masks, normalizes, combines, persists and builds events.

`RewardStack.score_step` is the whole validator step: every active reward model scores the step's
prompt and completions, each is normalized by its running normalizer, combined with the configured
weights, multiplied by every active mask (which see the base prompt), and turned into the event dict
with the spec's field names. Nothing here touches tensors: scorers and the memory layer do.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from rewardstack.config import ALL_MODELS, MASKS, REWARD_MODELS, StackConfig
from rewardstack.errors import InputError, StateError
from rewardstack.memory import MemoryManager, configure_allocator, maybe_empty_cache
from rewardstack.memory.budget import weights_bytes
from rewardstack.normalize import RunningNormalizer
from rewardstack.scorers import build_scorer
from rewardstack.scorers.base import Runtime, Scorer, ScoreRequest, ScoreResult, Status
from rewardstack.scorers.loading import ModelCache
from rewardstack.state import StateStore

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

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form `rewardstack score` reads (fields left unset are left out)."""
        d: dict[str, Any] = {"name": self.name, "prompt": self.prompt, "completions": list(self.completions)}
        for key in ("base_prompt", "uids", "completion_times", "block", "gating_loss", "set_weights", "new_forward_pass"):
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
        for key, value in [("prompt", d["prompt"]), ("base_prompt", base)] + [(f"completions[{i}]", c) for i, c in enumerate(comps)]:
            if isinstance(value, str) and not _is_valid_unicode(value):
                raise InputError("is not valid Unicode (it holds a lone surrogate)", line=line, field=key)
        # Completions arrive stripped in the validator; strip here so every scorer agrees.
        comps = [c.strip() if isinstance(c, str) else None for c in comps]
        return cls(
            name=d["name"], prompt=d["prompt"], completions=comps, base_prompt=base,
            uids=list(uids) if uids is not None else None,
            completion_times=[float(t) for t in times] if times is not None else None,
            block=d.get("block"), gating_loss=d.get("gating_loss"), set_weights=d.get("set_weights"),
            new_forward_pass=nfp,
        )


def _is_valid_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (lone surrogates such as \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class StepResult:
    """What scoring one step gives back."""

    rewards: list[float]
    best: str
    raw: dict[str, list[float]]
    normalized: dict[str, list[float]]
    statuses: list[str]
    """One status per completion: the most severe over every active scorer."""
    model_statuses: dict[str, list[str]]
    event: dict[str, Any] = field(default_factory=dict)


class RewardStack:
    """A configured set of reward models and masks with their persistent state."""

    def __init__(self, config: StackConfig, *, memory: MemoryManager | None = None, load_state: bool = True) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            configure_allocator()  # must precede the first CUDA allocation
        own_memory = memory is None
        self.memory = memory if memory is not None else MemoryManager(None, device=self.device, margin=config.safety_margin)
        self.models = ModelCache(self.device)
        self.runtime = Runtime(device=self.device, memory=self.memory, models=self.models)
        self.scorers: dict[str, Scorer] = {}
        capacity = self.memory.weights_capacity(config)
        on_device: dict[int, torch.nn.Module] = {}
        for cfg in config.active_models():
            log.info("building %s", cfg.name)
            scorer = self.scorers[cfg.name] = build_scorer(cfg, self.runtime)
            if capacity is not None:  # CUDA-only path
                self._stage(cfg.name, scorer, on_device, capacity)
        for name, scorer in self.scorers.items():
            modules = scorer.modules()
            if modules:
                # Filters are small: placement may keep them on CPU when the card is short.
                self.memory.register_model(name, modules, cpu_ok=scorer.kind == "mask")
        if own_memory:
            # Budget = device total x utilization - weights - headroom (or memory_budget), then
            # placement decides what stays resident when the weights alone do not fit.
            self.memory.setup(config)
        self.normalizers = {name: RunningNormalizer() for name in REWARD_MODELS}
        self.store = StateStore(config.state_dir)
        self.steps_scored = 0
        self._dormant: dict[str, dict[str, Any]] = {}
        if load_state:
            self.load_state()

    @staticmethod
    def _stage(name: str, scorer: Scorer, on_device: dict[int, torch.nn.Module], capacity: int) -> None:
        """Move a just-calibrated scorer's weights to the host if the device cannot keep them too.

        Each model loads and calibrates on the device; one that would push the weights past
        `capacity` waits on the host, and placement (`MemoryManager.setup`) then brings back what
        stays resident and swaps the rest in on demand.
        """
        new = {id(m): m for m in scorer.modules() if id(m) not in on_device}
        if not new:
            return
        if weights_bytes(list(on_device.values()) + list(new.values())) <= capacity:
            on_device.update(new)
            return
        log.info("placement: %s staged on the host while loading (weights past %d bytes)", name, capacity)
        for m in new.values():
            m.to("cpu")

    @classmethod
    def from_config(cls, path: str, **kwargs: Any) -> "RewardStack":
        """Build a stack from a TOML config file."""
        from rewardstack.config import load_config

        return cls(load_config(path), **kwargs)

    # -- state ------------------------------------------------------------------------------
    def state_sections(self) -> dict[str, dict[str, Any]]:
        """Everything that must outlive the process, by section."""
        # State of scorers switched off in this run is carried over untouched, not dropped.
        sections: dict[str, dict[str, Any]] = dict(self._dormant)
        sections |= {
            "normalizers": {n: norm.to_dict() for n, norm in self.normalizers.items()},
            "stack": {"steps_scored": self.steps_scored},
        }
        for name, scorer in self.scorers.items():
            st = scorer.state_dict()
            if st:
                sections[name] = st
        return sections

    def save_state(self) -> None:
        """Atomically persist normalizers and scorer state to the state directory."""
        self.store.save(self.state_sections())

    def load_state(self) -> None:
        """Restore persisted state, if any."""
        sections = self.store.load()
        self._dormant = {k: v for k, v in sections.items() if k in ALL_MODELS and k not in self.scorers}
        try:
            for name, d in sections.get("normalizers", {}).items():
                if name in self.normalizers:
                    self.normalizers[name] = RunningNormalizer.from_dict(d)
            self.steps_scored = int(sections.get("stack", {}).get("steps_scored", 0))
            for name, scorer in self.scorers.items():
                if name in sections:
                    scorer.load_state_dict(sections[name])
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"state in {self.store.path} is inconsistent: {e}") from e
        if sections:
            log.info("restored state from %s (%d steps scored before)", self.store.path, self.steps_scored)

    # -- scoring ----------------------------------------------------------------------------
    def score_step(self, step: Step | Mapping[str, Any], *, save: bool = True) -> StepResult:
        """Score one validator step and return rewards, per-model scores, statuses and the event."""
        if not isinstance(step, Step):
            step = Step.from_dict(step)
        started = time.time()
        n = len(step.completions)
        opens_pass = step.new_forward_pass if step.new_forward_pass is not None else step.name == "augment"
        if opens_pass:
            for scorer in self.scorers.values():
                scorer.begin_forward_pass()
        base_prompt = step.base_prompt if step.base_prompt is not None else step.prompt
        raw: dict[str, list[float]] = {}
        normalized: dict[str, list[float]] = {}
        model_statuses: dict[str, list[str]] = {}
        rewards = [0.0] * n
        for name in REWARD_MODELS:
            weight = self.config.models[name].weight
            if name not in self.scorers:
                raw[name] = [0.0] * n
                normalized[name] = [0.0] * n
                continue
            res = self._run(name, ScoreRequest(step.prompt, step.completions, step.name))
            raw[name] = res.scores
            normalized[name] = self.normalizers[name](res.scores)
            model_statuses[name] = res.statuses
            rewards = [r + weight * x for r, x in zip(rewards, normalized[name])]
        for name in MASKS:
            if name not in self.scorers:
                # A mask switched off logs zeros and is not applied.
                raw[name] = [0.0] * n
                normalized[name] = [0.0] * n
                continue
            res = self._run(name, ScoreRequest(base_prompt, step.completions, step.name))
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
        blacklist = self.scorers.get("blacklist_filter")
        if blacklist is not None and n:  # the reference records the best even when it is empty
            blacklist.record_best(step.name, best)  # type: ignore[attr-defined]
        self.steps_scored += 1
        result = StepResult(rewards, best, raw, normalized, statuses, model_statuses)
        result.event = self._event(step, result, time.time() - started)
        if save:
            self.save_state()
        if self.device.type == "cuda":
            maybe_empty_cache(self.device)  # only when measured fragmentation crosses the threshold
        return result

    def _run(self, name: str, request: ScoreRequest) -> ScoreResult:
        """One scorer on one request; a scorer that raises marks every live completion ERROR."""
        n = len(request.completions)
        try:
            res = self.scorers[name].score(request)
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

    def _event(self, step: Step, result: StepResult, elapsed: float) -> dict[str, Any]:
        n = len(step.completions)
        event: dict[str, Any] = {
            "name": step.name,
            "block": step.block,
            "gating_loss": step.gating_loss,
            "uids": step.uids if step.uids is not None else list(range(n)),
            "prompt": step.prompt,
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
