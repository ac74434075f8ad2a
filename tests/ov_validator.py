"""openvalidators 1.2.0's forward pass, for driving the drop-in the way a validator does.

Two sources of `forward`/`run_step`, with one fake neuron (`FakeNeuron`) around them:
- `real_forward_module(src)`: the validator's own `openvalidators/forward.py` and `event.py`,
  unmodified, read from a checkout (`$OPENVALIDATORS_SRC`, else the fetched mirror when this
  machine has it) and imported beside stubs of what they import that is not under test
  (`bittensor`'s logging, `loguru`, the block number, uid availability). `EventSchema.from_dict`
  is the real one, so its "is None, data will not be logged" warnings are counted.
- `transcription`: the same two coroutines transcribed (for machines without the source: CI).
  Differences: no bittensor logging, no gating model, `ttl_get_block` a constant.

`FakeNeuron` answers each dendrite call after an `await` (so concurrent forward passes interleave
as on a real validator), keeps the validator's `moving_averaged_scores`, counts warnings and
records every event `run_step` logs and what it would send to wandb.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import random
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

import torch

MIRROR = Path("/work/.mirror/opentensor+validators/repo")
TAG = "v1.2.0"
FILES = ("openvalidators/forward.py", "openvalidators/event.py", "openvalidators/prompts.py",
         "openvalidators/reward/config.py")


def real_source() -> Path | None:
    """A directory holding openvalidators 1.2.0's files, or None where this machine has no copy."""
    env = os.environ.get("OPENVALIDATORS_SRC")
    if env:
        return Path(env)
    if not MIRROR.exists():
        return None
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"openvalidators-{TAG}-{os.getpid()}"
    for f in FILES:
        text = subprocess.run(["git", "--git-dir", str(MIRROR), "show", f"{TAG}:{f}"], capture_output=True,
                              text=True, check=True).stdout
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_text(text)
    return out


@dataclass
class Warnings:
    lines: List[str] = field(default_factory=list)


WARNINGS = Warnings()


def _stub_modules() -> dict[str, types.ModuleType]:
    """bittensor (logging only), loguru, and the openvalidators modules forward.py imports but we don't test."""
    bt = types.ModuleType("bittensor")

    class _Logging:
        def debug(self, *a: Any, **k: Any) -> None: ...
        def trace(self, *a: Any, **k: Any) -> None: ...
        def info(self, *a: Any, **k: Any) -> None: ...
        def success(self, *a: Any, **k: Any) -> None: ...

        def warning(self, msg: Any, *a: Any, **k: Any) -> None:
            WARNINGS.lines.append(str(msg))

        def error(self, msg: Any, *a: Any, **k: Any) -> None:
            WARNINGS.lines.append(str(msg))

    bt.logging = _Logging()  # type: ignore[attr-defined]
    bt.DendriteCall = object  # type: ignore[attr-defined]
    loguru = types.ModuleType("loguru")
    loguru.logger = types.SimpleNamespace(log=lambda *a, **k: None)  # type: ignore[attr-defined]
    misc = types.ModuleType("openvalidators.misc")
    misc.ttl_get_block = lambda self: 1_000_000  # type: ignore[attr-defined]
    utils = types.ModuleType("openvalidators.utils")
    utils.check_uid_availability = lambda metagraph, uid, limit: True  # type: ignore[attr-defined]
    return {"bittensor": bt, "loguru": loguru, "openvalidators.misc": misc, "openvalidators.utils": utils}


PRESCORE_LINE = "    await self.reward_stack.score_step(prompt, responses, name, base_prompt)\n"
"""docs/VALIDATOR.md's one added line of `run_step`, before its reward loop."""
PRESCORE_BEFORE = "    # Compute the rewards for the responses given the prompt.\n"


def real_forward_module(src: Path, *, prescore: bool = False) -> types.ModuleType:
    """openvalidators.forward imported from `src`, its imports outside the test stubbed.

    `prescore` applies docs/VALIDATOR.md's edit of `run_step` (one line) to the real file first.
    """
    if prescore:
        forward_py = src / "openvalidators" / "forward.py"
        text = forward_py.read_text()
        assert text.count(PRESCORE_BEFORE) == 1, "forward.py is not openvalidators 1.2.0's"
        edited = src.parent / (src.name + "-prescore")
        for f in FILES:
            (edited / f).parent.mkdir(parents=True, exist_ok=True)
            (edited / f).write_text((src / f).read_text())
        (edited / "openvalidators" / "forward.py").write_text(text.replace(PRESCORE_BEFORE, PRESCORE_LINE + PRESCORE_BEFORE))
        src = edited
    saved = {k: sys.modules.get(k) for k in list(sys.modules) if k == "openvalidators" or k.startswith("openvalidators.")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(_stub_modules())
    pkg = types.ModuleType("openvalidators")
    pkg.__path__ = [str(src / "openvalidators")]  # type: ignore[attr-defined]
    sys.modules["openvalidators"] = pkg
    reward = types.ModuleType("openvalidators.reward")
    reward.__path__ = [str(src / "openvalidators" / "reward")]  # type: ignore[attr-defined]
    sys.modules["openvalidators.reward"] = reward
    reward.RewardModelType = importlib.import_module("openvalidators.reward.config").RewardModelType  # type: ignore[attr-defined]
    return importlib.import_module("openvalidators.forward")


# -- the transcription (openvalidators 1.2.0, forward.py) -----------------------------------------

def _event_fields() -> tuple[str, ...]:
    """The reward fields `EventSchema.from_dict` reads (it warns for each that is None)."""
    models = ("blacklist_filter", "dahoas_reward_model", "task_validator_filter", "nsfw_filter", "relevance_filter",
              "reciprocate_reward_model", "diversity_reward_model", "dpo_reward_model", "rlhf_reward_model",
              "prompt_reward_model")
    return models + tuple(m + "_normalized" for m in models if m != "blacklist_filter")


EVENT_FIELDS = _event_fields()


async def run_step(self: Any, prompt: str, k: int, timeout: float, name: str, exclude: list = [],  # noqa: B006
                   base_prompt: Any = None) -> dict:
    """run_step, transcribed; with `self.prescore`, docs/VALIDATOR.md's added line too."""
    if base_prompt is None:
        base_prompt = prompt
    event: dict[str, Any] = {"name": name}
    start_time = time.time()
    uids = torch.tensor(random.sample(range(self.metagraph_n), k), dtype=torch.int64)
    responses = await self.dendrite_pool.async_forward(uids=uids, roles=["user"], messages=[prompt], timeout=timeout)
    if getattr(self, "prescore", False):
        await self.reward_stack.score_step(prompt, responses, name, base_prompt)
    rewards = torch.zeros(len(responses), dtype=torch.float32)
    for weight_i, reward_fn_i in zip(self.reward_weights, self.reward_functions):
        reward_i, reward_i_normalized = reward_fn_i.apply(prompt, responses, name)
        rewards += weight_i * reward_i_normalized
        event[reward_fn_i.name] = reward_i.tolist()
        event[reward_fn_i.name + "_normalized"] = reward_i_normalized.tolist()
    for masking_fn_i in self.masking_functions:
        mask_i, mask_i_normalized = masking_fn_i.apply(base_prompt, responses, name)
        rewards *= mask_i_normalized
        event[masking_fn_i.name] = mask_i.tolist()
        event[masking_fn_i.name + "_normalized"] = mask_i_normalized.tolist()
    completions = [comp.completion for comp in responses]
    best = completions[rewards.argmax(dim=0)].strip()
    event.update({"block": 1_000_000, "step_length": time.time() - start_time, "prompt": prompt,
                  "uids": uids.tolist(), "completions": completions,
                  "completion_times": [comp.elapsed_time for comp in responses], "rewards": rewards.tolist(),
                  "gating_loss": 0.0, "best": best})
    for key in EVENT_FIELDS:  # EventSchema.from_dict's warning
        if event.get(key) is None:
            WARNINGS.lines.append(f"EventSchema.from_dict: {key} is None, data will not be logged")
    self.wandb.log(dict(event))
    return event


async def forward(self: Any) -> None:
    data = next(self.dataset)["text"]
    base_text = data
    aug_prompt = f"augment: {base_text}"
    self.blacklist.reset()
    augment_event = await run_step(self, prompt=aug_prompt, name="augment", k=self.config.neuron.followup_sample_size,
                                   timeout=1.0)
    base_text = augment_event["best"]
    base_prompt = augment_event["best"]
    exclude = augment_event["uids"]
    for k in range(self.config.neuron.num_followup_steps):
        prompt = f"followup {k}: {base_text}"
        followup_event = await run_step(self, prompt=prompt, name="followup" + str(k),
                                        k=self.config.neuron.followup_sample_size, timeout=1.0, exclude=exclude,
                                        base_prompt=base_prompt)
        exclude += followup_event["uids"]
        prompt = f"answer: {base_text} {followup_event['best']}"
        answer_event = await run_step(self, prompt=prompt, name="answer" + str(k),
                                      k=self.config.neuron.answer_sample_size, timeout=1.0, exclude=exclude,
                                      base_prompt=followup_event["best"])
        exclude += answer_event["uids"]
        self.blacklist.question_blacklist.append(followup_event["best"])
        self.blacklist.answer_blacklist.append(answer_event["best"])
        base_text = base_text + "\nQuestion:" + followup_event["best"] + "\nAnswer:" + answer_event["best"]


transcription = types.SimpleNamespace(forward=forward, run_step=run_step)


# -- the neuron around them -----------------------------------------------------------------------

@dataclass
class Call:
    """What bittensor's dendrite gives per miner (`bt.DendriteCall`, reduced)."""

    completion: str
    is_success: bool = True
    elapsed_time: float = 0.1


class FakeDendrite:
    """Miners answering after a short `await`: texts from the uid and the prompt, some failing."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    async def async_forward(self, uids: torch.Tensor, roles: list, messages: list, timeout: float) -> list[Call]:
        self.calls += 1
        await asyncio.sleep(self.delay * random.random())
        out = []
        for uid in uids.tolist():
            words = " ".join(f"w{(uid * 7 + len(messages[0]) + i) % 29}" for i in range(3 + uid % 5))
            if uid % 11 == 3:
                out.append(Call("", is_success=False))
            elif uid % 13 == 5:
                out.append(Call("That is an excellent question."))
            else:
                out.append(Call(f"  miner {uid} says {words}  "))
        return out


class FakeWandb:
    """The validator's wandb run: rows as `log` commits them (`commit=False` joins the next row)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}

    def log(self, data: dict[str, Any], commit: bool = True) -> None:
        self._pending.update(data)
        if commit:
            self.rows.append(self._pending)
            self._pending = {}


class FakeNeuron:
    """The attributes of openvalidators' `neuron` that forward()/run_step() read, around a drop-in."""

    def __init__(self, rs: Any, *, passes_data: list[str], delay: float = 0.02, followups: int = 2, k: int = 6,
                 metagraph_n: int = 40) -> None:
        self.reward_functions, self.reward_weights = rs.reward_functions, rs.reward_weights
        self.masking_functions, self.blacklist = rs.masking_functions, rs.blacklist
        self.diversity_model = rs.diversity_model
        self.reward_stack = rs
        self.prescore = False
        self.dendrite_pool = FakeDendrite(delay)
        self.dataset = iter([{"text": t} for t in passes_data])
        self.metagraph_n = metagraph_n
        self.metagraph = types.SimpleNamespace(n=torch.tensor(metagraph_n))
        self.device = "cpu"
        self.moving_averaged_scores = torch.zeros(metagraph_n)
        self.wandb = FakeWandb()
        if rs.wandb == "auto":  # the validator's run, as `wandb.run` would give it
            rs.wandb = lambda: self.wandb
        self.gating_model = _Gating(metagraph_n)
        self.config = types.SimpleNamespace(
            neuron=types.SimpleNamespace(followup_sample_size=k, answer_sample_size=k, followup_timeout=1.0,
                                         answer_timeout=1.0, num_followup_steps=followups, vpermit_tao_limit=1024,
                                         disable_log_rewards=False, dont_save_events=False, moving_average_alpha=0.05),
            wandb=types.SimpleNamespace(off=False))


class _Gating:
    """The validator's gating model: scores per uid and a loss (values do not matter here)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, prompt: str) -> torch.Tensor:
        return torch.zeros(self.n)

    def backward(self, scores: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        return torch.tensor(0.0)


def run_forwards(module: Any, neuron: FakeNeuron, *, concurrent: int, rounds: int = 1) -> None:
    """run.py's loop: `rounds` times, gather `concurrent` forward() coroutines on one loop."""
    WARNINGS.lines.clear()

    async def run_forward() -> None:
        await asyncio.gather(*[module.forward(neuron) for _ in range(concurrent)])

    loop = asyncio.new_event_loop()
    try:
        for _ in range(rounds):
            loop.run_until_complete(run_forward())
    finally:
        loop.close()


def events_of(neuron: FakeNeuron) -> list[dict[str, Any]]:
    """The events run_step sent to wandb (EventSchema's fields, or the transcription's whole event)."""
    return neuron.wandb.rows


__all__ = ["Call", "EVENT_FIELDS", "FakeNeuron", "WARNINGS", "events_of", "real_forward_module",
           "real_source", "run_forwards", "transcription"]
