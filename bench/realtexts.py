"""A small, varied set of real English (and some other) texts for the real-checkpoint tests and bench.

The random-word workload (`tests.soak.synthetic`) is fine for memory and speed, but a trained model
should also see text it was trained on. `bench/real_texts.json` holds four base prompts and 43 short
hand-written passages (science, validators, gardening, history, everyday notes, code, five other
languages, one-liners). `completions()` derives 100 completions from them, deterministically: the
passages; pairs; long concatenations past the 512-token bound of the MPNet tokenizer; heavy
repetition of a token, a word, a sentence, an emoji and a whole passage; near and exact
duplicates (adjacent, so the diversity history's duplicate rule runs); edge cases (empty, one
character, white space); and passages cut mid-sentence.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _data() -> dict[str, list[str]]:
    return json.loads((Path(__file__).with_name("real_texts.json")).read_text(encoding="utf-8"))


def prompts() -> list[str]:
    """The base prompts (one per simulated validator step)."""
    return list(_data()["prompts"])


def passages() -> list[str]:
    """The hand-written passages, as written."""
    return list(_data()["passages"])


def completions(n: int = 100, seed: int = 21) -> list[tuple[str, str]]:
    """`n` (label, completion) pairs; the first 100 always cover every kind listed above."""
    rng = random.Random(seed)
    ps = passages()
    out: list[tuple[str, str]] = [(f"passage{i}", p) for i, p in enumerate(ps)]
    for k in range(15):
        a, b = rng.sample(range(len(ps)), 2)
        out.append((f"pair{k}", ps[a] + " " + ps[b]))
    for k in range(3):  # 20 to 32 passages: about 700 to 1,500 tokens, past the 512-token bound
        picks = rng.sample(range(len(ps)), 20 + 6 * k)
        out.append((f"long{k}", " ".join(ps[j] for j in picks)))
    out += [
        ("repeat_the_600", ("the " * 600).strip()),
        ("repeat_word_200", ("reward " * 200).strip()),
        ("repeat_sentence_12", " ".join([ps[1]] * 12)),
        ("repeat_ha_1000", "ha" * 1000),
        ("repeat_yes_no_100", ("yes no " * 100).strip()),
        ("repeat_emoji_100", "🙂" * 100),
        ("repeat_passage_4", " ".join([ps[13]] * 4)),
        ("repeat_paris_60", ("Paris. " * 60).strip()),
    ]
    base = ps[6]
    out += [
        ("near_dup_a", base),
        ("near_dup_a_again", base),  # an exact adjacent duplicate: the history keeps one row
        ("near_dup_b", base.replace("validator", "validating node")),
        ("near_dup_c", base.replace("weights", "scores")),
        ("near_dup_d", base + " That is all."),
        ("near_dup_e", base.upper()),
    ]
    out += [("empty", ""), ("one_char", "a"), ("space", " "), ("ok", "ok")]
    k = 0
    while len(out) < n:  # passages cut after a random number of words
        words = ps[rng.randrange(len(ps))].split(" ")
        out.append((f"cut{k}", " ".join(words[: rng.randint(1, max(1, len(words) - 1))])))
        k += 1
    return out[:n]


def steps(n: int = 100, size: int = 10) -> list[tuple[str, list[tuple[str, str]]]]:
    """`completions(n)` as validator steps of `size`: (base prompt, [(label, completion)]).

    Completions are ordered by character length before they are cut into steps, so the few past
    the 512-token bound share a step (a literal reference pads each step's batch to its longest
    completion: mixing them in would pad every step to 512 tokens and multiply its cost).
    """
    ordered = sorted(completions(n), key=lambda lc: len(lc[1]))
    ps = prompts()
    return [(ps[k % len(ps)], ordered[i: i + size]) for k, i in enumerate(range(0, len(ordered), size))]
