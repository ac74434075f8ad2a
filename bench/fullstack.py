"""Throughput of the full default stack: rewardstack against the reference, pipelines and the floor.

One stack (the offline stand-ins of the openvalidators default: DPO, OpenAssistant, Reciprocate,
relevance, diversity, NSFW and the two rule masks) scores the workload; per model its share of the
time is taken from the same run. Beside it, on the same stand-in weights:
- the reference: a literal per-completion implementation of the semantics (one completion at a time,
  full-precision full logits, no bounds; the transcriptions the tests use), timed on a subset of
  steps and compared with rewardstack's time on the same subset;
- `transformers.pipeline` with batching for the two classifiers (what a user would reach for);
- the floor: the forward passes the semantics need with the least work (`bench.floors`), timed
  alone. DPO's floor includes its head over the scored rows (the matmul and the log-sum-exp over
  the vocabulary): exact log-probabilities need both.
Timings run without the tensor tracker, as on a GPU.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from bench import floors
from bench.common import timed
from rewardstack.config import load_config
from rewardstack.stack import RewardStack, Step
from rewardstack._state import RewardState


@dataclass
class StackTimes:
    """Seconds per model and in all, over the whole workload and over the reference's subset."""

    n: int
    n_ref: int
    stack_s: float
    stack_ref_subset_s: float
    model_s: dict[str, float]
    floor_s: dict[str, float]
    ref_s: dict[str, float]
    pipeline_s: dict[str, float] = field(default_factory=dict)
    ours_classifiers_s: float = 0.0
    load_s: float = 0.0
    floor_total: float = 0.0
    """The floor's total: per step its fastest run, summed (as the stack's total is taken)."""

    @property
    def ref_total(self) -> float:
        return sum(self.ref_s.values())


TINY = False
"""`python -m bench --smoke` sets this: the tiny stand-ins (`tests/soak/tiny.py`: the same families
and code paths at hidden size 16) instead of the standard ones, so every row runs in seconds."""


def build_stack(root: Path, *, device: str = "cpu", extra: dict[str, Any] | None = None) -> RewardStack:
    """The stand-in default stack under `root` (stand-ins built once), with a fresh state dir."""
    from rewardstack._standins import make_standins
    from tests.soak.tiny import make_tiny_standins

    cfg = load_config(make_tiny_standins(root / "standins") if TINY else make_standins(root / "standins"))
    cfg.device = device
    cfg.state_dir = str(root / f"state-{time.monotonic_ns()}")
    for k, v in (extra or {}).items():
        setattr(cfg, k, v)
    return RewardStack(cfg)


def _timed_scorers(stack: RewardStack, acc: dict[str, float]) -> None:
    """Wrap every scorer's forward (`score`, or `stateless_part` for a stateful scorer such as
    diversity, whose stateful half runs in the stack's state) so the stack's run also yields each
    model's share of the time. A scorer the step never reaches through that method would print "-"."""
    for name, sc in stack.scorers.items():
        attr = "stateless_part" if getattr(sc, "stateful", False) else "score"
        inner = getattr(sc, attr)

        def wrapped(*a: Any, _inner: Callable = inner, _name: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                acc[_name] = acc.get(_name, 0.0) + time.perf_counter() - t

        setattr(sc, attr, wrapped)


def reference_step(stack: RewardStack, step: Step) -> dict[str, float]:
    """The per-completion reference of every active model on one step: seconds per model."""
    from causal_fixtures import reference_dpo
    from encoder_fixtures import ref_bert_embedding, ref_mpnet_embedding, ref_nsfw, ref_openassistant
    from rewardstack._scorers import reciprocate

    sc = stack.scorers
    comps = floors.live(step)
    base = step.base_prompt or step.prompt
    out: dict[str, float] = {}

    def rec(c: str) -> None:
        r = sc["reciprocate_reward_model"]
        inp = r.tokenizer(reciprocate.TEMPLATE.format(prompt=step.prompt, completion=c), return_tensors="pt", truncation=True)
        with torch.no_grad():
            r.model(**inp)

    def rel(c: str) -> None:  # the reference re-embeds the prompt for every completion
        r = sc["relevance_filter"]
        m1, t1, m2, t2 = r.first.model, r.first.tokenizer, r.second.model, r.second.tokenizer
        e, p = ref_bert_embedding(m1, t1, c), ref_bert_embedding(m1, t1, base)
        if -float(((e - p) ** 2).mean().sqrt()) >= r.bounds[0]:
            ref_mpnet_embedding(m2, t2, [c]), ref_mpnet_embedding(m2, t2, [base])

    per_completion: dict[str, Callable[[str], Any]] = {
        "dpo_reward_model": lambda c: reference_dpo(sc["dpo_reward_model"].model, sc["dpo_reward_model"].tokenizer, step.prompt, c),
        "rlhf_reward_model": lambda c: ref_openassistant(sc["rlhf_reward_model"].model, sc["rlhf_reward_model"].tokenizer, step.prompt, c),
        "reciprocate_reward_model": rec,
        "relevance_filter": rel,
        "nsfw_filter": lambda c: ref_nsfw(sc["nsfw_filter"].model, sc["nsfw_filter"].tokenizer, c),
    }
    for name, fn in per_completion.items():
        if name in sc:
            out[name] = timed(lambda fn=fn: [fn(c) for c in comps])
    if "diversity_reward_model" in sc and comps:  # the reference embeds the step's completions in one call
        d = sc["relevance_filter"].second
        out["diversity_reward_model"] = timed(lambda: ref_mpnet_embedding(d.model, d.tokenizer, comps))
    return out


def floor_times(stack: RewardStack, steps: list[Step]) -> dict[str, float]:
    """The floor of every model-backed scorer of the stack over `steps`."""
    sc = stack.scorers
    out: dict[str, float] = {}
    if "dpo_reward_model" in sc:
        body, head = floors.dpo(sc["dpo_reward_model"], steps)
        out["dpo_reward_model"] = body + head
    if "rlhf_reward_model" in sc:
        out["rlhf_reward_model"] = floors.openassistant(sc["rlhf_reward_model"], steps)
    if "reciprocate_reward_model" in sc:
        out["reciprocate_reward_model"] = floors.reciprocate_floor(sc["reciprocate_reward_model"], steps)
    if "relevance_filter" in sc:
        cache = stack.runtime.options.get("embedding_cache")
        f_rel, f_div = floors.embeddings(sc["relevance_filter"], steps, cache)
        out["relevance_filter"] = f_rel
        if "diversity_reward_model" in sc:
            out["diversity_reward_model"] = f_div
    if "nsfw_filter" in sc:
        out["nsfw_filter"] = floors.nsfw(sc["nsfw_filter"], steps)
    return out


def pipeline_times(stack: RewardStack, steps: list[Step], batch_size: int = 16) -> dict[str, float]:
    """`transformers.pipeline("text-classification")` with batching, for the two classifiers."""
    from transformers import pipeline

    sc = stack.scorers
    out: dict[str, float] = {}
    if "rlhf_reward_model" in sc:
        oa = sc["rlhf_reward_model"]
        pipe = pipeline("text-classification", model=oa.model, tokenizer=oa.tokenizer, device=oa.model.device,
                        batch_size=batch_size, function_to_apply="none")
        pairs = [{"text": s.prompt, "text_pair": c} for s in steps for c in floors.live(s)]
        out["rlhf_reward_model"] = timed(lambda: list(pipe(pairs, truncation=True, max_length=oa.max_length)))
    if "nsfw_filter" in sc:
        ns = sc["nsfw_filter"]
        pipe = pipeline("text-classification", model=ns.model, tokenizer=ns.tokenizer, device=ns.model.device,
                        batch_size=batch_size, top_k=None)
        texts = [c for s in steps for c in floors.live(s)]
        out["nsfw_filter"] = timed(lambda: list(pipe(texts, truncation=True, max_length=ns.window)))
    return out


def measure(root: Path, steps: list[Step], ref_idx: list[int], *, device: str = "cpu", repeats: int = 3) -> StackTimes:
    """Score `steps` with the stand-in default stack and time every comparison on the same weights.

    Step by step, the stack scores the step and the floor runs that step's passes, `repeats`
    times interleaved (the stack from the same state and embedding cache each time); per step the
    fastest of each counts, for the totals and per model alike (the same statistic on both sides).
    Pairing at the step keeps the two under the same machine speed: on this shared 2-core machine
    the speed drifts by 20-40% over minutes, and whole-run interleaving moved the ratio by 0.1-0.2.
    The reference and the pipelines run once.
    """
    t = time.perf_counter()
    stack = build_stack(root, device=device)
    load_s = time.perf_counter() - t
    stack.memory.tracker = None  # timings pay no dispatch hook (as on a GPU)
    warm = Step(name="augment", prompt="warm-up", completions=["a short warm-up answer"], base_prompt="warm-up")
    stack.score_step(warm, save=False)  # first-call costs (thread pools, kernels) out of the timing
    acc: dict[str, float] = {}
    _timed_scorers(stack, acc)
    cache = stack.runtime.options.get("embedding_cache")
    stack.state = RewardState(stack.config)
    if cache is not None:
        cache.clear()
    per_step: list[float] = []
    floor_step: list[float] = []
    model_s: dict[str, float] = {}
    fl: dict[str, float] = {}
    for step in steps:
        state0 = copy.deepcopy(stack.state)
        cache0 = copy.copy(cache)  # the embedding cache is an OrderedDict: its entries in LRU order
        best, best_floor = float("inf"), float("inf")
        best_model: dict[str, float] = {}
        best_fl: dict[str, float] = {}
        after: tuple[Any, Any] = (None, None)
        for _ in range(max(1, repeats)):
            stack.state = copy.deepcopy(state0)  # the same work each time
            if cache is not None:
                cache.clear()
                cache.update(cache0)
            acc.clear()
            took = timed(lambda: stack.score_step(step, save=False))
            if took < best:
                best = took
            after = (stack.state, copy.copy(cache))
            for k, v in acc.items():
                best_model[k] = min(best_model.get(k, float("inf")), v)
            f = floor_times(stack, [step])  # the floor clears the embedding cache: restored after
            best_floor = min(best_floor, sum(f.values()))
            for k, v in f.items():
                best_fl[k] = min(best_fl.get(k, float("inf")), v)
        stack.state = after[0]
        if cache is not None:
            cache.clear()
            cache.update(after[1])
        per_step.append(best)
        floor_step.append(best_floor)
        for k, v in best_model.items():
            model_s[k] = model_s.get(k, 0.0) + v
        for k, v in best_fl.items():
            fl[k] = fl.get(k, 0.0) + v
    n = sum(len(floors.live(s)) for s in steps)
    ref_steps = [steps[k] for k in ref_idx]
    ref_s: dict[str, float] = {}
    for s in ref_steps:
        for k, v in reference_step(stack, s).items():
            ref_s[k] = ref_s.get(k, 0.0) + v
    pipe = pipeline_times(stack, steps)
    ours_cls = sum(model_s.get(k, 0.0) for k in pipe)
    return StackTimes(
        n=n, n_ref=sum(len(floors.live(s)) for s in ref_steps), stack_s=sum(per_step),
        stack_ref_subset_s=sum(per_step[k] for k in ref_idx), model_s=model_s, floor_s=fl, ref_s=ref_s,
        pipeline_s=pipe, ours_classifiers_s=ours_cls, load_s=load_s, floor_total=sum(floor_step),
    )


def rows(t: StackTimes) -> list[list[str]]:
    """The table rows: per model and for the whole stack."""
    out = []
    for name in t.floor_s:
        ours = t.model_s.get(name, 0.0)
        fl = t.floor_s.get(name)
        ref = t.ref_s.get(name)
        out.append([
            name, f"{t.n / ours:.1f}" if ours else "-", f"{t.n_ref / ref:.1f}" if ref else "-",
            f"{t.n / fl:.1f}" if fl else "-", f"{ours / fl:.2f}x" if fl and ours else "-",
        ])
    out.append(["whole stack", f"{t.n / t.stack_s:.1f}", f"{t.n_ref / t.ref_total:.1f}" if t.ref_total else "-",
                f"{t.n / t.floor_total:.1f}", f"{t.stack_s / t.floor_total:.2f}x"])
    return out
