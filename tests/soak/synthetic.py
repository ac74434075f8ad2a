"""Synthetic validator steps with heavy-tailed completion lengths: the soak's, the tests' and the bench's.

Real validator traffic is mostly short completions with a rare very long one (the kind that crashed
the OpenAssistant model). `heavy_tailed_steps` makes that shape reproducibly from a seed.
"""

from __future__ import annotations

import random

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
