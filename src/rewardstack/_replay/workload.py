"""Synthetic validator steps: the soak's workload, and the tests' and benchmarks'.

Real validator traffic is mostly short completions with a rare very long one (the kind that crashed
the OpenAssistant model). `heavy_tailed_steps` makes that shape reproducibly from a seed. The soak
(`soak_steps`, written as the step JSONL `score` reads by `write_steps`) adds one completion of
>= 8,000 tokens every `LONG_EVERY` steps, and with `pathological` the kinds of
`rewardstack._replay.pathological`: growing prompts and lines with unpaired surrogates (input
errors, refused with their line).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rewardstack.stack import Step

_WORDS = (
    "the model answer question summary data memory budget token layer value reward miner "
    "validator prompt network gradient attention policy sample batch score length python "
    "über naïve café 東京 данные λόγος ✓ 🙂"
).split()

TASKS = ("augment", "followup0", "answer0", "followup1", "answer1", "followup2", "answer2", "followup3", "answer3")


def text(rng: random.Random, chars: int) -> str:
    """Random words (unicode included) of about `chars` characters."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars].strip()


def heavy_tailed_lengths(rng: random.Random, n: int, *, median: int = 300, cap: int = 6000) -> list[int]:
    """Character lengths drawn log-normally (median `median`), capped at `cap`."""
    return [min(cap, int(rng.lognormvariate(0, 1.0) * median)) for _ in range(n)]


def heavy_tailed_steps(
    n_steps: int = 9,
    n_completions: int = 50,
    *,
    seed: int = 0,
    long_chars: int = 40_000,
    prompt_chars: int = 400,
) -> list[Step]:
    """`n_steps` steps of `n_completions` completions; one completion of `long_chars` characters."""
    rng = random.Random(seed)
    steps = []
    for s in range(n_steps):
        base = text(rng, prompt_chars // 2)
        task = TASKS[s % len(TASKS)]
        prompt = base if task == "augment" else f"{base}\n\nAsk or answer about the text above: {text(rng, prompt_chars // 2)}"
        comps: list[str | None] = [text(rng, k) for k in heavy_tailed_lengths(rng, n_completions)]
        steps.append(Step(name=task, prompt=prompt, base_prompt=base, completions=comps, uids=list(range(n_completions))))
    if steps and long_chars:
        steps[len(steps) // 2].completions[0] = text(rng, long_chars)
    return steps


LONG_EVERY = 50
LONG_CHARS = 50_000  # >= 8,000 tokens with the stand-ins' BERT tokenizer (about 10,000)


def soak_steps(n: int, n_completions: int = 50, *, seed: int = 0, pathological: bool = False,
               long_every: int = LONG_EVERY) -> list[Step]:
    """N validator steps: heavy-tailed lengths (median >= 200 chars), one very long completion every `long_every` steps."""
    from rewardstack._replay import pathological as path

    steps = heavy_tailed_steps(n, n_completions, seed=seed, long_chars=0)
    rng = random.Random(seed + 1)
    for s, step in enumerate(steps):
        if long_every and s % long_every == min(10, n // 2):
            step.completions[rng.randrange(len(step.completions))] = text(rng, LONG_CHARS)
    if pathological:
        path.grow_prompts(steps)
        path.mix_into(steps, seed)
    return steps


def write_steps(path: Path, steps: list[Step], *, surrogate_every: int = 0) -> int:
    """Write the step JSONL; every `surrogate_every`-th step is followed by a bad line. Returns bad lines."""
    bad = 0
    with path.open("w", encoding="utf-8") as f:
        for s, step in enumerate(steps):
            f.write(json.dumps(step.to_dict(), ensure_ascii=False) + "\n")
            if surrogate_every and s % surrogate_every == surrogate_every - 1:
                from rewardstack._replay.pathological import surrogate_line

                f.write(surrogate_line(step) + "\n")
                bad += 1
    return bad
