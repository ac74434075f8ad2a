"""Pathological inputs, mixed into generated steps: what breaks naive scorers, each one named.

Every kind must come out of the stack scored or with an explicit per-completion status, and none may
stop the scoring loop:

- `empty`, `whitespace`: an empty answer and one of white space only (stripped to empty);
- `prompt_itself`: the completion is the step's prompt (the blacklist's base-prompt rule);
- `huge`: 100,000 characters;
- `repeated_token`: one token repeated thousands of times (DPO's repetition penalty, NSFW windows);
- `control_chars`: NUL, bell, escape sequences and other C0/C1 control characters;
- `rtl`: right-to-left text with RLM/RLO/PDF marks;
- `astral`: emoji and other astral-plane characters (surrogate pairs in UTF-16, 4 bytes in UTF-8);
- `unpaired_surrogate`: a lone `\\ud800` in the JSON text: not valid Unicode, so the whole line is
  an input error (reported with its line number, the rest of the file is scored);
- `growing_prompt`: within a forward pass each step's prompt is the previous step's prompt plus a
  completion of it, as the validator builds follow-ups and answers, so prompts grow step by step.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from rewardstack.stack import Step

from tests.soak.synthetic import text

HUGE_CHARS = 100_000
_MAKERS: dict[str, Callable[[random.Random, str], str]] = {
    "empty": lambda rng, prompt: "",
    "whitespace": lambda rng, prompt: " \t\n \u00a0\u2003 \r\n",
    "prompt_itself": lambda rng, prompt: prompt,
    "huge": lambda rng, prompt: text(rng, HUGE_CHARS),
    "repeated_token": lambda rng, prompt: " ".join(["the"] * rng.randint(3000, 6000)),
    "control_chars": lambda rng, prompt: "start\x00middle\x01\x02\x07bell\x08\x0b\x0c\x1b[31mred\x1b[0m\x7f\x85\x9f end",
    "rtl": lambda rng, prompt: ("\u200fمرحبا بالعالم\u200e and \u202eреверс\u202c \u05e9\u05dc\u05d5\u05dd "
                                "\u2067isolate\u2069"),
    "astral": lambda rng, prompt: "🙂🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈𐌰 🧪👩‍👩‍👧‍👦 🏳️‍🌈 \U0001F9EA" * 3,
}
KINDS = tuple(_MAKERS)
"""Kinds that become one completion each (the surrogate and growing-prompt kinds act on lines and prompts)."""


def completion(kind: str, rng: random.Random, prompt: str) -> str:
    """One pathological completion of `kind` (one of `KINDS`)."""
    return _MAKERS[kind](rng, prompt)


def mix_into(steps: list[Step], seed: int = 0, *, every: int = 3) -> None:
    """Replace completions of every `every`-th step with pathological ones (all kinds, cycling), in place."""
    rng = random.Random(seed)
    k = 0
    for s, step in enumerate(steps):
        if s % every:
            continue
        slots = list(range(len(step.completions)))
        rng.shuffle(slots)
        for i in slots[: min(len(slots), 3)]:
            kind = KINDS[k % len(KINDS)]
            k += 1
            step.completions[i] = completion(kind, rng, step.prompt)


def grow_prompts(steps: list[Step]) -> None:
    """Within each forward pass, each step's prompt becomes the previous one plus one of its completions (in place)."""
    prev: Step | None = None
    for step in steps:
        if step.name == "augment" or prev is None:
            prev = step
            continue
        grown = next((c for c in prev.completions if c), "")
        step.prompt = f"{prev.prompt}\n\n{grown[:2000]}\n\n{step.prompt}"
        prev = step


def surrogate_line(step: Step) -> str:
    """The step as a JSONL line whose first completion holds an unpaired surrogate (an input error)."""
    d: dict[str, Any] = step.to_dict()  # its own copy of the completions (`Step.to_dict` copies lists)
    d["completions"][0] = "broken \ud800 surrogate"
    return json.dumps(d, ensure_ascii=True)  # JSON's \ud800 escape: valid JSON, not valid Unicode

