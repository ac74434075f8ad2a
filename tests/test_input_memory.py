"""What a huge completion costs before and around the models: one copy of the text, a slice to hash,
and no quadratic attention mask for a long completion after a shared prompt.

`[input] max_chars` bounds what the models read (tests/test_hostile_input.py); these tests bound
what the rest of the loop holds while a 50 MB line is read, hashed and scored (bench/memory.py,
row `huge-completion`, measures the whole).
"""

from __future__ import annotations

import hashlib
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import GPT2Config, GPT2Model

from rewardstack._fileio import canonical_chunks
from rewardstack._runner import iter_steps, step_hash
from rewardstack._scorers.prefix import PrefixRunner, runs_whole
from rewardstack.stack import Step

MB = 1 << 20


def _dumps(obj: Any) -> bytes:
    # The hash's definition, transcribed: what step_hash hashed before it was fed in pieces.
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _random_json(r: random.Random, depth: int = 0) -> Any:
    chars = ['a', '"', '\\', '\n', '\x00', '\x1f', 'é', '\u2028', '\ud800', '\udfff', '\U0001f600', ' ', '/']
    kind = r.randint(0, 6 if depth < 4 else 4)
    if kind == 0:
        return r.choice([None, True, False, 0, -3, 10**20, 0.1, -0.0, 1e300, float("nan"), float("inf")])
    if kind <= 3:
        return "".join(r.choice(chars) for _ in range(r.randint(0, 30)))
    if kind == 4:
        return [_random_json(r, depth + 1) for _ in range(r.randint(0, 4))]
    if kind == 5:
        return {"".join(r.choice(chars) for _ in range(r.randint(0, 5))): _random_json(r, depth + 1)
                for _ in range(r.randint(0, 4))}
    return {2: "non-string keys", 1: None}  # json.dumps converts and sorts them itself


def test_canonical_chunks_are_json_dumps_byte_for_byte() -> None:
    r = random.Random(22)
    for _ in range(1500):
        obj = _random_json(r)
        for slice_chars in (1, 2, 3, 7, 1 << 20):  # slices cut inside escapes' neighbours and surrogates
            assert b"".join(canonical_chunks(obj, slice_chars=slice_chars)) == _dumps(obj)


def test_step_hash_is_unchanged_and_needs_a_slice_not_the_text() -> None:
    text = "word \"quoted\" é\n " * (16 * MB // 18)
    step = Step(name="augment", prompt="p", completions=["short", text, None])
    expected = hashlib.sha256(_dumps(step.to_dict())).hexdigest()[:16]  # outputs written before stay resumable
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        got = step_hash(step)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert got == expected
    # Whole, json.dumps and its encoding held about three copies (48 MB) beside the step.
    assert peak < 6 * MB, f"hashing a 16 MB completion took {peak / MB:.1f} MB"


def test_reader_holds_one_copy_of_a_long_line_while_its_step_is_scored(tmp_path: Path) -> None:
    n = 8 * MB
    path = tmp_path / "steps.jsonl"
    steps = [{"name": "augment", "prompt": "p", "completions": ["a", "x" * n]}, {"name": "augment", "prompt": "q", "completions": ["b"]}]
    path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    tracemalloc.start()
    try:
        with path.open("rb") as f:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            seen = []
            for number, step in iter_steps(f):
                live, peak = (x - base for x in tracemalloc.get_traced_memory())
                seen.append((number, live, peak))
                del step
    finally:
        tracemalloc.stop()
    number, live, peak = seen[0]
    assert number == 1 and [s[0] for s in seen] == [1, 2]
    # While step 1 is scored only its parsed text is alive: the raw line was kept by enumerate's
    # reused result tuple (2 copies); the read itself holds two copies at a time, not three.
    assert live < 1.25 * n, f"{live / MB:.1f} MB live for an {n / MB:.0f} MB line"
    assert peak < 2.5 * n, f"{peak / MB:.1f} MB peak reading an {n / MB:.0f} MB line"


class _LargestOutput(TorchDispatchMode):
    """The largest tensor (elements) any aten op returns inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=500, n_positions=1024)).eval()


def test_long_unpadded_suffix_runs_whole_without_a_quadratic_mask() -> None:
    body = _gpt2()
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 500, (9,), generator=g).tolist()
    suffix = torch.randint(0, 500, (700,), generator=g).tolist()
    assert runs_whole(len(prefix), [suffix])
    runner = PrefixRunner(body, prefix)
    with torch.inference_mode():
        runner.state()  # the prefix pass (short) out of the watch
        watch = _LargestOutput()
        with watch:
            hidden, mask = runner.run([suffix])
        full = body(input_ids=torch.tensor([prefix + suffix])).last_hidden_state[0]
    # Through the cache, transformers builds the causal mask [1, 1, 700, 709] (and sdpa a float
    # copy of it): 496,300 elements; the whole run's largest tensor is the MLP's [1, 709, 128].
    assert watch.largest < 700 * 700 // 4, f"largest tensor {watch.largest} elements"
    assert hidden.shape[:2] == (1, 700) and bool(mask.all())
    got = runner.rows(hidden, torch.zeros(709, dtype=torch.long), torch.arange(709))
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


def test_padded_or_short_suffixes_keep_the_cache() -> None:
    assert not runs_whole(9, [[1] * 700, [1] * 699])  # padded: the mask is needed either way
    assert not runs_whole(9, [[1] * 5])  # shorter than the prefix: reusing its cache saves more
    assert not runs_whole(0, [[1] * 700])  # no prefix: nothing to choose
    assert not runs_whole(9, [[1] * 71, [2] * 71])  # under 8x the prefix: the prediction assumed the cache
    assert runs_whole(9, [[1] * 72, [2] * 72])
