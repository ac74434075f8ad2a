"""The soak's workload: synthetic steps (`synthetic.py`), written as the step JSONL `score` reads.

One completion of >= 8,000 tokens every `LONG_EVERY` steps, and with `pathological` the kinds of
`tests.soak.pathological`: growing prompts and lines with unpaired surrogates (input
errors, refused with their line).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rewardstack.stack import Step

from tests.soak.pathological import grow_prompts, mix_into, surrogate_line
from tests.soak.synthetic import heavy_tailed_steps, text

LONG_EVERY = 50
LONG_CHARS = 50_000  # >= 8,000 tokens with the stand-ins' BERT tokenizer (about 10,000)


def soak_steps(n: int, n_completions: int = 50, *, seed: int = 0, pathological: bool = False,
               long_every: int = LONG_EVERY) -> list[Step]:
    """N validator steps: heavy-tailed lengths (median >= 200 chars), one very long completion every `long_every` steps."""
    steps = heavy_tailed_steps(n, n_completions, seed=seed, long_chars=0)
    rng = random.Random(seed + 1)
    for s, step in enumerate(steps):
        if long_every and s % long_every == min(10, n // 2):
            step.completions[rng.randrange(len(step.completions))] = text(rng, LONG_CHARS)
    if pathological:
        grow_prompts(steps)
        mix_into(steps, seed)
    return steps


def write_steps(path: Path, steps: list[Step], *, surrogate_every: int = 0) -> int:
    """Write the step JSONL; every `surrogate_every`-th step is followed by a bad line. Returns bad lines."""
    bad = 0
    with path.open("w", encoding="utf-8") as f:
        for s, step in enumerate(steps):
            f.write(json.dumps(step.to_dict(), ensure_ascii=False) + "\n")
            if surrogate_every and s % surrogate_every == surrogate_every - 1:
                f.write(surrogate_line(step) + "\n")
                bad += 1
    return bad
