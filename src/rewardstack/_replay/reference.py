"""What the unbounded openvalidators reference would have asked for on one input (`replay`'s report).

The input's tokens are counted, untruncated, with the scorer's own tokenizer; the full-size
simulation (`rewardstack._planning.simulate`) then runs the reference's call on the meta device, in
the reference's dtype, with the default stack's architectures:

- OpenAssistant: the whole (prompt, completion) pair in float32, untruncated (the seed report's OOM);
- the other reward models and NSFW: one input, cut to the position limit the reference cut it to;
- relevance: its two encoders in turn, each on the completion alone (reward-semantics.md). The first
  (bert-base-uncased) embeds every overflow window of the text in one batch (windows of the max
  length, the last padded), so what it asks for grows with the text; the second
  (all-mpnet-base-v2) reads the text cut to its bound. The figure is the larger of the two passes:
  the first's activations are freed before the second runs;
- diversity: all-mpnet-base-v2 on every completion of the step at once (a failed one as the empty
  text the reference got), padded to the longest, cut to its bound.

Never extrapolated: without a tokenizer to count with, or when the simulation fails, the figure is
unavailable and the note says why.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rewardstack.config import REWARD_MODELS
from rewardstack._models import DIVERSITY, RELEVANCE, spec
from rewardstack._planning import simulate as sim
from rewardstack.stack import Step

log = logging.getLogger("rewardstack.replay")

Figure = tuple[int | None, int | None, int | None, str]
"""(untruncated tokens, reference peak bytes, its largest single allocation, note)."""

NO_TOKENIZER = "unavailable: the model has no tokenizer to count the input's tokens"


def _count(tok: Any, model: str, text: str, pair: str | None = None) -> int | None:
    """Untruncated token count of `text` (or of the pair (`text`, `pair`)), None when it cannot be told."""
    if tok is None:
        return None
    try:
        ids = tok(text, pair, truncation=False)["input_ids"] if pair is not None else tok(text, truncation=False)["input_ids"]
        return len(ids)
    except Exception as e:  # noqa: BLE001 - a figure for the report, never a crash
        log.info("%s: cannot count tokens: %s", model, e)
        return None


def _failed(e: Exception) -> str:
    return f"unavailable: the simulation failed ({type(e).__name__}: {e})"


def _relevance(scorer: Any, text: str) -> Figure:
    first, second = getattr(scorer, "first", None), getattr(scorer, "second", None)
    n1 = _count(getattr(first, "tokenizer", None), RELEVANCE.name, text)
    n2 = _count(getattr(second, "tokenizer", None), RELEVANCE.name, text)
    if n1 is None or n2 is None:
        return n1, None, None, NO_TOKENIZER
    try:
        bound1, bound2 = int(sim.scorer_bound(f"{RELEVANCE.name}[0]")), int(sim.scorer_bound(f"{RELEVANCE.name}[1]"))
        # Each window holds bound - 2 content tokens between its two special tokens, no stride.
        windows = max(1, math.ceil((n1 - 2) / (bound1 - 2)))
        length = min(n1, bound1)
        a = sim.simulate_peak(f"{RELEVANCE.name}[0]", windows, length, padded=windows > 1, exact=False)
        b = sim.reference_need(f"{RELEVANCE.name}[1]", min(n2, bound2))
    except Exception as e:  # noqa: BLE001
        return n1, None, None, _failed(e)
    note = (f"bert-base-uncased: {windows} windows of {length} tokens in one batch; "
            f"all-mpnet-base-v2: {min(n2, bound2)} tokens" + (" (the reference's truncation)" if n2 > bound2 else ""))
    return n1, int(max(a.peak_bytes, b.peak_bytes)), int(max(a.largest_alloc_bytes, b.largest_alloc_bytes)), note


def _diversity(scorer: Any, step: Step, i: int) -> Figure:
    tok = getattr(getattr(scorer, "embedder", None), "tokenizer", None)
    counts = [_count(tok, DIVERSITY.name, c or "") for c in step.completions]
    if any(n is None for n in counts):
        return counts[i], None, None, NO_TOKENIZER
    try:
        bound = int(sim.scorer_bound(DIVERSITY.name))
        rows = [min(n, bound) for n in counts]  # type: ignore[type-var]
        res = sim.simulate_peak(DIVERSITY.name, len(rows), max(rows), padded=len(set(rows)) > 1, exact=False)
    except Exception as e:  # noqa: BLE001
        return counts[i], None, None, _failed(e)
    note = f"all-mpnet-base-v2: the step's {len(rows)} completions in one batch at {max(rows)} tokens"
    return counts[i], int(res.peak_bytes), int(res.largest_alloc_bytes), note


def reference_need_of(scorer: Any, model: str, step: Step, i: int) -> Figure:
    """The reference's need for completion `i` of `step` on `model`, counted with `scorer`'s tokenizer."""
    completion = step.completions[i] or ""
    if model == RELEVANCE.name:
        return _relevance(scorer, completion)
    if model == DIVERSITY.name:
        return _diversity(scorer, step, i)
    # Reward models read the prompt; masks the base prompt (the step's prompt when it has none).
    prompt = step.prompt if model in REWARD_MODELS or step.base_prompt is None else step.base_prompt
    tok = getattr(scorer, "tokenizer", None)
    tokens = (_count(tok, model, prompt, completion) if spec(model).pair_input
              else _count(tok, model, prompt + completion))
    if tokens is None:
        return None, None, None, NO_TOKENIZER
    try:  # the reference's one-input call; it truncated the other models to their position limit
        n = tokens if spec(model).reference_unbounded else min(tokens, int(sim.scorer_bound(model)))
        res = sim.reference_need(model, n)
    except Exception as e:  # noqa: BLE001
        return tokens, None, None, _failed(e)
    note = f"{n} tokens" + (" (the reference's truncation)" if n < tokens else "")
    return tokens, int(res.peak_bytes), int(res.largest_alloc_bytes), note

