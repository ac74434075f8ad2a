"""Memory against input length, memory against uptime, and step time against completions per step.

- Length: each scorer's peak tracked tensor bytes for one completion of 500 ... 100,000 characters,
  rewardstack against the literal per-completion reference. The reference is measured for real only
  where it fits this machine comfortably (its peak grows with the input); past that, and for the
  real models at full size, the figures come from the meta-device simulation
  (`rewardstack._planning.simulate`) and are marked simulated.
- Uptime: memory at rest (the tracker's live bytes and the process RSS) after each of N short steps;
  the only growth allowed is the diversity history until it is full.
- Scaling: seconds per step for 10 ... 200 completions per step (linear or better).
"""

from __future__ import annotations

import random
import resource
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bench.common import peak_of, timed
from rewardstack._memory import TensorBytesTracker
from rewardstack._scorers.base import ScoreRequest
from rewardstack.stack import RewardStack, Step
from tests.soak.synthetic import heavy_tailed_lengths, text

LENGTHS = (500, 2_000, 8_000, 32_000, 100_000)
# Largest completion (characters) whose reference is run for real per model: beyond it the
# reference's peak (full logits / unbounded attention on the stand-in) would take GBs of this
# machine's 24 GiB, or minutes. The rest come from the simulation.
REF_MEASURED_UP_TO = {
    "dpo_reward_model": 32_000, "rlhf_reward_model": 32_000, "reciprocate_reward_model": 100_000,
    "relevance_filter": 100_000, "diversity_reward_model": 100_000, "nsfw_filter": 100_000,
}
# Stand-in scorer -> the full-size model the simulation knows it as.
SIMULATED = {
    "dpo_reward_model": "dpo_reward_model", "rlhf_reward_model": "rlhf_reward_model",
    "reciprocate_reward_model": "reciprocate_reward_model", "nsfw_filter": "nsfw_filter",
    "relevance_filter": "relevance_filter[0]", "diversity_reward_model": "diversity_reward_model",
}


@dataclass
class LengthRow:
    model: str
    chars: int
    ours_bytes: int
    ref_bytes: int | None
    ref_simulated: bool
    sim_ours_bytes: int | None = None
    sim_ref_bytes: int | None = None


def _reference_fn(stack: RewardStack, name: str, prompt: str) -> Callable[[str], Any] | None:
    from causal_fixtures import reference_dpo
    from encoder_fixtures import ref_bert_embedding, ref_mpnet_embedding, ref_nsfw, ref_openassistant
    from rewardstack._scorers import reciprocate

    sc = stack.scorers[name]
    if name == "dpo_reward_model":
        return lambda c: reference_dpo(sc.model, sc.tokenizer, prompt, c)
    if name == "rlhf_reward_model":
        return lambda c: ref_openassistant(sc.model, sc.tokenizer, prompt, c)
    if name == "nsfw_filter":
        return lambda c: ref_nsfw(sc.model, sc.tokenizer, c)
    if name == "reciprocate_reward_model":
        def rec(c: str) -> None:
            inp = sc.tokenizer(reciprocate.TEMPLATE.format(prompt=prompt, completion=c), return_tensors="pt", truncation=True)
            sc.model(**inp)
        return rec
    if name == "relevance_filter":
        return lambda c: (ref_bert_embedding(sc.first.model, sc.first.tokenizer, c),
                          ref_mpnet_embedding(sc.second.model, sc.second.tokenizer, [c]))
    if name == "diversity_reward_model":
        emb = stack.scorers["relevance_filter"].second if "relevance_filter" in stack.scorers else None
        return (lambda c: ref_mpnet_embedding(emb.model, emb.tokenizer, [c])) if emb is not None else None
    return None


def _simulated(model: str, tokens: int) -> tuple[int | None, int | None]:
    """(rewardstack, unbounded reference) peak bytes of the real model at full size, simulated.

    Ours: one input cut to the scorer's bound. The reference: OpenAssistant untruncated (the
    reference passed no limit); the others at most at their position limit, as the reference cut them.
    """
    from rewardstack._planning import simulate

    bound = simulate.scorer_bound(model)
    ours = simulate.simulate_peak(model, 1, max(2, min(tokens, bound)), padded=False, exact=False).peak_bytes
    if model == "dpo_reward_model":
        # The reference's DPO pass (full [L, V] logits, a per-position loop) is not simulated;
        # `reference_need` would give our chunked pass under the reference's name.
        return int(ours), None
    ref_tokens = tokens if model == "rlhf_reward_model" else min(tokens, bound)
    ref = simulate.reference_need(model, max(2, ref_tokens)).peak_bytes
    return int(ours), int(ref)


def memory_vs_length(stack: RewardStack, lengths: tuple[int, ...] = LENGTHS, *, measure_ref: bool = True) -> list[LengthRow]:
    """Peak bytes of one completion per length, per scorer (ours tracked; reference tracked or simulated)."""
    rng = random.Random(11)
    prompt = text(rng, 200)
    texts = {n: text(random.Random(n), n) for n in lengths}
    cache = stack.runtime.options.get("embedding_cache")
    out: list[LengthRow] = []
    saved = stack.memory.tracker
    stack.memory.tracker = TensorBytesTracker(None)  # counts; no budget
    try:
        for name, sc in stack.scorers.items():
            if name not in REF_MEASURED_UP_TO:
                continue
            ref_fn = _reference_fn(stack, name, prompt)
            for n in lengths:
                if cache is not None:
                    cache.clear()  # each length measured cold (no embedding reuse)
                ours = peak_of(lambda: sc.score(ScoreRequest(prompt, [texts[n]], "augment")))
                ref = None
                if measure_ref and ref_fn is not None and n <= REF_MEASURED_UP_TO[name]:
                    with torch.no_grad():
                        ref = peak_of(lambda: ref_fn(texts[n]))
                tokens = n // 4  # English-like text: about 4 characters a token
                sim_ours, sim_ref = _simulated(SIMULATED[name], tokens)
                out.append(LengthRow(name, n, ours, ref, ref is None, sim_ours, sim_ref))
    finally:
        stack.memory.tracker = saved
    return out


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def short_steps(n: int, completions: int, seed: int = 3) -> list[Step]:
    """`n` short steps (about 100 characters a completion), distinct texts."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        base = text(rng, 120)
        out.append(Step(name="augment" if k % 9 == 0 else f"followup{k % 4}", prompt=base, base_prompt=base,
                        completions=[text(rng, 60 + rng.randrange(80)) for _ in range(completions)]))
    return out


def memory_vs_uptime(stack: RewardStack, n_steps: int, completions: int) -> dict[str, Any]:
    """Live tracked bytes and RSS at rest after each step; their slopes (bytes per step) once the
    diversity history is full (else over the last half)."""
    tracker = TensorBytesTracker(None)
    stack.memory.tracker = tracker
    live, rss, hist = [], [], []
    for step in short_steps(n_steps, completions):
        with tracker:  # tensors the step keeps (history, caches) are counted while they live
            stack.score_step(step, save=False)
        live.append(tracker.live_bytes)
        rss.append(rss_bytes())
        h = stack.state.diversity.history
        hist.append(int(h.shape[0]) if isinstance(h, torch.Tensor) else 0)
    full_at = next((k for k in range(1, len(hist)) if hist[k] == hist[k - 1] and hist[k] > 0), None)
    # The slope where memory should be flat: once the diversity history is full (it grows by design
    # until then), else over the last half.
    start = full_at if full_at is not None and len(live) - full_at >= 10 else len(live) // 2
    return {"live": live, "rss": rss, "history_rows": hist, "history_full_at": full_at, "slope_from": start,
            "live_slope": _slope(live[start:]), "rss_slope": _slope(rss[start:])}


def _slope(ys: list[int]) -> float:
    """Least-squares slope of `ys` against the step index (bytes per step)."""
    if len(ys) < 2:
        return 0.0
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def step_time_vs_completions(stack: RewardStack, sizes: tuple[int, ...], repeats: int = 2) -> list[tuple[int, float]]:
    """(completions per step, median seconds per step) on heavy-tailed lengths without a long outlier."""
    stack.memory.tracker = None
    rng = random.Random(21)
    out = []
    for n in sizes:
        times = []
        for _ in range(repeats):
            base = text(rng, 200)
            step = Step(name="augment", prompt=base, base_prompt=base,
                        completions=[text(rng, k) for k in heavy_tailed_lengths(rng, n, cap=4000)])
            times.append(timed(lambda: stack.score_step(step, save=False)))
        out.append((n, statistics.median(times)))
    return out
