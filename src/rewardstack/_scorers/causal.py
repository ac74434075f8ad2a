"""What the decoder (causal) reward scorers share: DPO, Reciprocate, Dahoas and the judge.

Each loads a decoder checkpoint, caps its batches at `batch_size` or its `max_batch` option,
profiles its own scoring path at load on dummy inputs up to its `calibration_length` option (the
planner admits no longer input), runs a step's inputs through the memory layer and writes each
completion's outcome back: its value, or NaN and the status of the part that did not run. This
base holds those parts; a family keeps its model, its input and its number.

A family that scores through `PrefixRunner` (`prefix.py`) sets, at load, `body`, `vocab`,
`fill_id` and `use_prefix`, and says what runs after the prefix (`_profile_forward(runner, ids)`:
its scoring forward on `ids`); the profile's dummy passes then take its own path, prefix cache
included. A family that profiles otherwise (the judge's generation) replaces `_dummy` instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rewardstack.config import ModelConfig
from rewardstack._hub import load_source
from rewardstack._memory.calibration import Profile
from rewardstack._scorers.base import Runtime, Scorer, fill
from rewardstack._scorers.prefix import PrefixRunner, dummy_ids, model_device, profile_runner


class CausalScorer(Scorer):
    """A decoder-based reward model: its checkpoint, batch cap, load-time profile and outcomes."""

    kind = "reward"
    max_len: int
    """The longest input, in tokens, the scorer reads (set at load)."""
    use_prefix: bool = False
    """Whether a step's common token prefix runs once through a KV cache (set at load)."""
    body: torch.nn.Module
    """The decoder without its head, which `PrefixRunner` runs."""
    vocab: int
    """The vocabulary's size (the profile's random ids are drawn from it)."""
    fill_id: int
    """The id padded positions get."""
    head: torch.nn.Module
    """What `_forward` applies to one position's hidden state (Reciprocate's `score`, Dahoas's value head)."""

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        self.cfg, self.runtime = cfg, runtime
        self.max_batch = cfg.batch_size or cfg.options.max_batch

    def _pretrained(self, auto_class: Any) -> tuple[Any, Any]:
        """(tokenizer, model) of the configured checkpoint: a locked commit, remote code only if allowed."""
        source, how = load_source(self.cfg, str(self.cfg.path))
        return self.runtime.models.pretrained(source, auto_class, dtype=self.cfg.dtype, **how)

    @property
    def calib_len(self) -> int:
        """The longest input of the load-time profile: the planner admits no more."""
        return min(self.max_len, self.cfg.options.calibration_length or self.max_len)

    def _calibrate(self, *, max_batch: int, prefixed: bool = False, **extra: Any) -> None:
        """Profile the scoring path at load (`MemoryManager.calibrate`): `_dummy` passes up to
        `calib_len` tokens and `max_batch` rows; `prefixed`: passes after a shared prefix too, for
        a scorer that tells `memory.run` its prefix (the fit predicts those passes)."""
        self.runtime.memory.calibrate(Profile(
            self.name, self._dummy, max_length=self.calib_len, max_batch=max_batch,
            prefix_run=self._dummy_after_prefix if prefixed and self.use_prefix else None, **extra))

    def _dummy(self, b: int, length: int) -> None:
        """A profile pass: B random sequences of `length` tokens."""
        self._dummy_after_prefix(b, length, 1)()

    def _dummy_after_prefix(self, b: int, length: int, prefix: int) -> Callable[[], object]:
        """A profile pass whose rows share their first `prefix` tokens, as a step's inputs share its
        prompt: the prefix runs now (as `MemoryManager.run`'s `prepare` runs it), the returned call
        runs the rest."""
        ids = dummy_ids(self.vocab, b, length)  # random ids: DPO's penalty sees the most columns
        runner = profile_runner(self.body, ids, enabled=self.use_prefix, pad_id=self.fill_id, prefix=prefix)
        with torch.inference_mode():
            runner.state()
        return lambda: self._profile_forward(runner, ids)

    def _forward(self, runner: PrefixRunner, ids: list[list[int]], pos: list[int] | None = None,
                 types: list[list[int]] | None = None) -> list[float]:
        """`head` at absolute position `pos` of each input (default: its last token), the inputs (full
        ids, prefix included; `types`: their token types) run against the runner's prefix. DPO,
        which reads every row's logits, has its own."""
        h, _ = runner.run([x[runner.length :] for x in ids], [t[runner.length :] for t in types] if types else None)
        device = model_device(self.body)
        pos = [len(x) - 1 for x in ids] if pos is None else pos
        rows = runner.rows(h, torch.arange(len(ids), device=device), torch.tensor(pos, device=device))
        return self.head(rows)[:, 0].float().tolist()

    def _profile_forward(self, runner: PrefixRunner, ids: list[list[int]]) -> list[float]:
        """A profile pass's scoring forward: `head` at each input's last token (DPO has its own)."""
        return self._forward(runner, ids)

    _fill = staticmethod(fill)  # the outcome unpacking every causal family ends with (`base.fill`)
