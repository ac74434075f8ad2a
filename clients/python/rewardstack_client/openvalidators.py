"""The openvalidators 1.x drop-in: the validator's reward and masking functions, backed by rewardstack.

The validator (openvalidators 1.2.0, `forward.py`'s `run_step`) holds `reward_functions` with
`reward_weights`, `masking_functions` and a `blacklist`, and for each step calls

    reward_i, reward_i_normalized = reward_fn_i.apply(prompt, responses, name)    # each model
    mask_i, mask_i_normalized = masking_fn_i.apply(base_prompt, responses, name)  # each mask

then combines them (`rewards += w * normalized`, `rewards *= mask`) and takes the argmax as best.
`OpenValidatorsStack` gives objects with that interface, so a validator swaps its stack in a few
lines of `neuron.py` (docs/VALIDATOR.md):

    rs = OpenValidatorsStack.remote(Client(url, namespace=hotkey), weights=self.reward_weights)
    self.reward_functions, self.reward_weights = rs.reward_functions, rs.reward_weights
    self.masking_functions, self.blacklist = rs.masking_functions, rs.blacklist
    self.diversity_model = rs.diversity_model

How a step is scored:
- **Once, whole.** The service scores the whole step at the first call of it; every function then
  returns its column of that one answer. The step is committed once (the client's sequence number
  makes its resends safe).
- **Per forward pass.** `blacklist.reset()`, which `forward()` calls first, opens a forward pass
  in the calling coroutine's context (`contextvars`: each of the `--neuron.num_concurrent_forwards`
  coroutines `run.py` gathers is its own asyncio task), so concurrent passes never share a step,
  a cache entry or the bests their base prompts come from. A cached answer is only ever returned
  for the same (pass, name, prompt, completions).
- **The base prompt.** The first call of a step comes from a reward function, before the validator
  has passed the masks' base prompt, so it is derived the validator's way from this pass's bests
  (augment: the prompt; followupN: augment's best; answerN: followupN's best). A mask that then
  passes another base prompt raises `StepMismatch`. `await rs.score_step(...)` (below) sends the
  validator's own base prompt and needs no deriving.
- **Not blocking the loop.** `apply` is synchronous (the validator calls it without `await`), so
  it blocks the validator's event loop while the service scores. One line in `run_step`,
  `await self.reward_stack.score_step(prompt, responses, name, base_prompt)` before its reward
  loop, scores the step in a worker thread while the loop runs on; the `apply` calls after it are
  answered from the cache. A thread rather than an async client because the sync and async paths
  must share one sequence counter per namespace.
- **Models switched off** appear too, so the validator's events carry all twenty fields: a reward
  model with weight 0 and a mask switched off in the service's config are zero-weight reward
  functions returning the service's zeros (a mask that is off is not applied; openvalidators'
  `MockRewardModel` as a mask would multiply every reward by 0).
- **What the step cost** (per-completion statuses, the service's memory record) goes to the
  validator's wandb run in the row of the step (`commit=False` at the step's last `apply`, before
  `run_step` logs its event) and to `on_step` callbacks; completions the service could not score
  (`oom`, `error`) are logged as warnings, since the validator would otherwise take them for
  failed miners.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import sys
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from rewardstack_client._errors import StepMismatch, WeightsMismatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("rewardstack_client.openvalidators")

REWARD_MODELS: Tuple[str, ...] = ("dpo_reward_model", "rlhf_reward_model", "reciprocate_reward_model",
                                  "dahoas_reward_model", "prompt_reward_model")
"""openvalidators 1.2.0's reward models in `neuron.py`'s order, which its weights tensor follows."""
WEIGHT_FLAGS: Dict[str, str] = dict(zip(REWARD_MODELS, (
    "--reward.dpo_weight", "--reward.rlhf_weight", "--reward.reciprocate_weight", "--reward.dahoas_weight",
    "--reward.prompt_based_weight")))
MASKS: Tuple[str, ...] = ("blacklist_filter", "task_validator_filter", "relevance_filter", "diversity_reward_model",
                          "nsfw_filter")
"""openvalidators 1.2.0's masking functions in `neuron.py`'s order."""
BLACKLIST = "blacklist_filter"
UNSCORED = ("oom", "error")
"""Per-completion statuses that mean the service could not score a completion (not the miner's fault)."""

ScoreFn = Callable[[Dict[str, Any]], Dict[str, Any]]
"""A step dict in, its event dict out (the `rewardstack score` event line's fields plus `sequence`)."""
StepCallback = Callable[[Dict[str, Any]], None]


def _completion(response: Any) -> Optional[str]:
    """A response's completion, stripped, or None for a failed call (bittensor's `is_success`)."""
    if isinstance(response, str):
        return response.strip()
    if response is None or not getattr(response, "is_success", True):
        return None
    return str(getattr(response, "completion", "")).strip()


def _value(x: Any) -> float:
    return math.nan if x is None else float(x)


class _Step:
    """A step this forward pass committed, and the service's answer."""

    def __init__(self, name: str, prompt: str, base_prompt: str, completions: Tuple[Optional[str], ...],
                 event: Dict[str, Any]) -> None:
        self.name, self.prompt, self.base_prompt, self.completions = name, prompt, base_prompt, completions
        self.event = event
        self.published = False


class _Pass:
    """One forward pass: the bests its later steps take their base prompts from, and its last step."""

    def __init__(self, *, opened: bool) -> None:
        self.opened = opened  # the next step tells the service a new forward pass begins
        self.bests: Dict[str, str] = {}
        self.step: Optional[_Step] = None

    def base_for(self, name: str, prompt: str) -> str:
        """The masks' base prompt as the validator's `forward()` passes it."""
        if name.startswith("followup") and "augment" in self.bests:
            return self.bests["augment"]
        if name.startswith("answer") and "followup" + name[len("answer"):] in self.bests:
            return self.bests["followup" + name[len("answer"):]]
        return prompt

    def cached(self, name: str, completions: Tuple[Optional[str], ...], prompt: Optional[str],
               base_prompt: Optional[str]) -> Optional[_Step]:
        """This pass's committed step if the call is one of its calls; None for a new step."""
        s = self.step
        if s is None or s.name != name or s.completions != completions:
            return None
        if prompt is not None and prompt != s.prompt:
            return None  # same name and completions, another prompt: another step
        if base_prompt is not None and base_prompt != s.base_prompt:
            raise StepMismatch(
                f"step '{name}' was scored with base prompt {s.base_prompt[:80]!r} (derived from this forward "
                f"pass's bests) but the mask got {base_prompt[:80]!r}. The validator's best differs from the "
                "service's (are the weights the service's?); add `await ...score_step(prompt, responses, name, "
                "base_prompt)` before run_step's reward loop so the step is scored with the validator's own "
                "base prompt (docs/VALIDATOR.md)")
        return s


class _Session:
    """The backend, the forward passes (one per coroutine context) and the step observers."""

    def __init__(self, score: ScoreFn, on_step: List[StepCallback], wandb: Any) -> None:
        self.score = score
        self.on_step = on_step
        self.wandb = wandb
        self.current: contextvars.ContextVar[_Pass] = contextvars.ContextVar(f"rewardstack_pass_{id(self)}")
        self.outside = _Pass(opened=False)  # calls made before any reset (a script, a test)
        # Steps of concurrent passes reach the backend one at a time, in the order they are sent
        # (the service numbers them; an in-process stack is not thread-safe).
        self.lock = threading.Lock()

    def this_pass(self) -> _Pass:
        return self.current.get(self.outside)

    def open_pass(self) -> None:
        self.current.set(_Pass(opened=True))

    def step(self, p: _Pass, name: str, responses: Sequence[Any], *, prompt: Optional[str],
             base_prompt: Optional[str]) -> _Step:
        """The step of this call in pass `p`, scored by the service if it is a new one."""
        completions = tuple(_completion(r) for r in responses)
        hit = p.cached(name, completions, prompt, base_prompt)
        if hit is not None:
            return hit
        if name == "augment":
            p.bests = {}
        base = base_prompt if base_prompt is not None else p.base_for(name, prompt or "")
        text = prompt if prompt is not None else base  # a mask called first: the masks' text is all it has
        body: Dict[str, Any] = {"name": name, "prompt": text, "completions": list(completions), "base_prompt": base}
        if p.opened:
            body["new_forward_pass"] = True
        with self.lock:
            event = self.score(body)
        p.opened = False
        p.step = _Step(name, text, base, completions, event)
        p.bests[name] = str(event.get("best") or "")
        self._observe(p.step)
        return p.step

    def _observe(self, s: _Step) -> None:
        statuses = s.event.get("statuses") or []
        bad = [i for i, st in enumerate(statuses) if st in UNSCORED]
        if bad:
            log.warning("step '%s' (sequence %s): completion(s) %s not scored (%s): they get 0 like a failed "
                        "miner; the service's memory report says why", s.name, s.event.get("sequence"),
                        ", ".join(map(str, bad)), ", ".join(sorted({statuses[i] for i in bad})))
        for callback in self.on_step:
            callback(s.event)

    def publish(self, s: _Step) -> None:
        """Hand the step's record to the validator's wandb run, once, into the row of its event."""
        if s.published:
            return
        s.published = True
        run = self._wandb_run()
        if run is not None:
            run.log(wandb_record(s.event), commit=False)

    def _wandb_run(self) -> Any:
        if self.wandb is None or self.wandb is False:
            return None
        if self.wandb == "auto":  # the validator's own run, if it has one (never imports wandb itself)
            module = sys.modules.get("wandb")
            return getattr(module, "run", None) if module is not None else None
        return self.wandb() if callable(self.wandb) and not hasattr(self.wandb, "log") else self.wandb


def wandb_record(event: Dict[str, Any]) -> Dict[str, Any]:
    """The step's extra wandb fields: sequence, status counts, unscored completions, memory record."""
    statuses = event.get("statuses") or []
    out: Dict[str, Any] = {"rewardstack/sequence": event.get("sequence")}
    for status, n in Counter(statuses).items():
        out[f"rewardstack/statuses/{status}"] = n
    out["rewardstack/unscored"] = [i for i, st in enumerate(statuses) if st in UNSCORED]
    memory = event.get("memory") or {}
    for key, value in memory.items():
        if isinstance(value, dict):
            for model, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"rewardstack/_memory/{key}/{model}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"rewardstack/_memory/{key}"] = value
    return out


class RewardFunction:
    """One reward model or mask, with openvalidators' `BaseRewardModel.apply` interface."""

    def __init__(self, owner: "OpenValidatorsStack", name: str, *, mask: bool) -> None:
        self._owner = owner
        self._name = name
        self.mask = mask

    @property
    def name(self) -> str:
        """The event name (`rlhf_reward_model`, `blacklist_filter`, ...)."""
        return self._name

    def __repr__(self) -> str:
        return self._name

    def apply(self, prompt: str, responses: Sequence[Any], name: str) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """(raw, normalized) float32 tensors, one value per response; failed ones NaN and 0."""
        import torch  # the validator's own; never a dependency of this package

        session = self._owner._session
        step = session.step(session.this_pass(), name, responses, prompt=None if self.mask else prompt,
                            base_prompt=prompt if self.mask else None)
        event = step.event
        raw = torch.tensor([_value(x) for x in event[self._name]], dtype=torch.float32)
        normalized = torch.tensor([_value(x) for x in event[self._name + "_normalized"]], dtype=torch.float32)
        if self is self._owner._last:  # run_step logs its event next, with no await in between
            session.publish(step)
        return raw, normalized


class Blacklist(RewardFunction):
    """The blacklist mask; `reset()` opens a new forward pass (the validator calls it per pass)."""

    def __init__(self, owner: "OpenValidatorsStack") -> None:
        super().__init__(owner, BLACKLIST, mask=True)
        self.question_blacklist: List[str] = []
        self.answer_blacklist: List[str] = []

    def reset(self) -> None:
        """Start a forward pass in the calling coroutine (the service forgets the pass's bests)."""
        self.question_blacklist = []
        self.answer_blacklist = []
        self._owner._session.open_pass()


class DiversityState:
    """What the validator's `save_state`/`load_state` read of `self.diversity_model`.

    The diversity history lives in the service's state (saved with every step there), so the
    validator's copy is an empty tensor it may save and load without effect or warning.
    """

    name = "diversity_reward_model"

    @property
    def historic_embeddings(self) -> "torch.Tensor":
        import torch

        return torch.zeros(0)

    @historic_embeddings.setter
    def historic_embeddings(self, value: Any) -> None:
        pass  # the service's history is the one that counts


class OpenValidatorsStack:
    """The validator-facing set: `reward_functions`, `reward_weights`, `masking_functions`, `blacklist`.

    `score` is the backend (a step dict in, its event out); `weights` the service's reward weights
    by model; `active_masks` the masks the service applies. `on_step` callbacks get each step's
    event; `wandb` is "auto" (the validator's active wandb run, if any), None, a run, or a
    callable returning one.
    """

    def __init__(self, score: ScoreFn, weights: Dict[str, float], active_masks: Sequence[str], *,
                 on_step: Optional[List[StepCallback]] = None, wandb: Any = "auto") -> None:
        self.on_step: List[StepCallback] = list(on_step or [])
        self._session = _Session(score, self.on_step, wandb)
        self.blacklist = Blacklist(self)
        self.masking_functions: List[RewardFunction] = [
            self.blacklist if n == BLACKLIST else RewardFunction(self, n, mask=True) for n in MASKS if n in active_masks]
        # Every reward model, and the masks that are off, as zero-weight reward functions: the
        # validator's events then carry all twenty fields, with the service's zeros for those.
        off_masks = [RewardFunction(self, n, mask=False) for n in MASKS if n not in active_masks]
        self.reward_functions: List[RewardFunction] = [RewardFunction(self, n, mask=False) for n in REWARD_MODELS] + off_masks
        self.reward_weights: List[float] = [float(weights.get(n, 0.0)) for n in REWARD_MODELS] + [0.0] * len(off_masks)
        self.diversity_model = DiversityState()
        self._last = (self.masking_functions or self.reward_functions)[-1]

    @property
    def wandb(self) -> Any:
        """Where each step's record goes: "auto" (the active `wandb.run`), None, a run, or a callable."""
        return self._session.wandb

    @wandb.setter
    def wandb(self, value: Any) -> None:
        self._session.wandb = value

    @classmethod
    def remote(cls, client: Any, *, weights: Any = None, on_step: Optional[List[StepCallback]] = None,
               wandb: Any = "auto") -> "OpenValidatorsStack":
        """Backed by the scoring service through a `rewardstack_client.Client` (waits for the service).

        `weights`: the validator's own reward weights (its `self.reward_weights` tensor from the
        `--reward.*_weight` flags, in `REWARD_MODELS` order, or a dict by model); a weight that is
        not the service's raises `WeightsMismatch` naming the flag, so the flags keep meaning what
        they say. None skips the check.
        """
        info = client.stack()
        served = {m["name"]: float(m["weight"]) for m in info["models"] if m["kind"] == "reward"}
        if weights is not None:
            check_weights(weights, served, where=str(getattr(getattr(client, "http", None), "base_url", "the service")))
        masks = [m["name"] for m in info["models"] if m["kind"] == "mask"]
        return cls(client.score, served, masks, on_step=on_step, wandb=wandb)

    def score(self, prompt: str, responses: Sequence[Any], name: str, base_prompt: Optional[str] = None) -> Dict[str, Any]:
        """Score the step now with the validator's base prompt (blocking); its event dict."""
        s = self._session
        return s.step(s.this_pass(), name, responses, prompt=prompt,
                      base_prompt=base_prompt if base_prompt is not None else prompt).event

    async def score_step(self, prompt: str, responses: Sequence[Any], name: str,
                         base_prompt: Optional[str] = None) -> Dict[str, Any]:
        """`score` in a worker thread, so the validator's event loop runs on while the service scores.

        Call it in `run_step` before the reward loop; the `apply` calls that follow are answered
        from this step's result.
        """
        s = self._session
        p = s.this_pass()  # read here: the worker thread does not run in this coroutine's context
        call = functools.partial(s.step, p, name, list(responses), prompt=prompt,
                                 base_prompt=base_prompt if base_prompt is not None else prompt)
        step = await asyncio.get_running_loop().run_in_executor(None, call)
        return step.event


def check_weights(weights: Any, served: Dict[str, float], *, where: str = "the service") -> None:
    """Raise `WeightsMismatch` unless the validator's reward weights are the service's."""
    if hasattr(weights, "tolist"):
        weights = weights.tolist()
    mine = dict(weights) if isinstance(weights, dict) else dict(zip(REWARD_MODELS, (float(w) for w in weights)))
    wrong = [f"{WEIGHT_FLAGS.get(n, n)} is {w:g} here but {served.get(n, 0.0):g} in the service's config "
             f"([models.{n}] weight)" for n, w in mine.items() if abs(float(w) - served.get(n, 0.0)) > 1e-6]
    if wrong:
        raise WeightsMismatch(f"the validator's reward weights are not those {where} scores with: " + "; ".join(wrong)
                              + ". Set the flags to the service's values or change the service's config and restart it")


__all__ = ["Blacklist", "DiversityState", "MASKS", "OpenValidatorsStack", "REWARD_MODELS", "RewardFunction",
           "WEIGHT_FLAGS", "check_weights", "wandb_record"]
