"""Benchmark of the encoder scorers (OpenAssistant, Reciprocate, NSFW, relevance, diversity).

Run: `.venv/bin/python -m bench.encoders [--ref-steps N]` (`python -m bench` runs every benchmark). On the 9-step, 50-completion heavy-tailed
workload (one 40,000-character completion) it prints, per model and for the whole set: completions/s
and peak tracked tensor bytes for rewardstack, for the literal per-completion reference (the test
suite's), and for the floor: forward passes alone over pre-tokenized minimal inputs, timed in the
same run (the faster of two schedules: length-sorted groups with <= 25% padding, or one-window
passes). Floors: OpenAssistant, the pairs cut to 512; NSFW, every 512-id window; relevance, BERT
windows of the base prompt and each completion, MPNet over the base prompt and the completions that
pass model 1; diversity, MPNet over the completions relevance did not already embed (the checkpoint
is shared, so the set's floor embeds each text once); Reciprocate (causal), the step's common token
prefix once plus each input's remaining tokens attending to it (bench/causal.py's floor).

Timings run without the tensor tracker (as on a GPU); peaks come from tracked passes over the step
that holds the 40,000-character completion, and from single-completion steps of 500 and 40,000
characters.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench import floors
from bench.common import MiB, peak_of, timed
from encoder_fixtures import (
    config, make_runtime, make_standins, ref_bert_embedding, ref_mpnet_embedding, ref_nsfw, ref_openassistant,
)

from rewardstack._scorers import classifier, embedding
from rewardstack._scorers.base import ScoreRequest
from rewardstack._standins import make_reciprocate_standin
from tests.soak.synthetic import Step, heavy_tailed_steps, text

ORDER = ("rlhf_reward_model", "reciprocate_reward_model", "relevance_filter", "diversity_reward_model", "nsfw_filter")


class Bench:
    """Builds the stand-ins once and collects rows of the table."""

    def __init__(self, root: Path, steps: list[Step], ref_steps: int) -> None:
        self.root, self.steps = root, steps
        self.entries = make_standins(root)
        self.heavy = max(steps, key=lambda s: max(len(c or "") for c in s.completions))
        # The reference's first `ref_steps` steps, and always the heavy one (the reference's worst).
        self.ref_steps = [s for k, s in enumerate(steps) if k < ref_steps or s is self.heavy]
        self.rt = make_runtime()
        self.rows: list[list[str]] = []
        self.set: dict[str, float] = {"ours": 0.0, "ref": 0.0, "floor": 0.0}
        self.flat: list[str] = []

    def build(self, name: str, builder: Callable) -> Any:
        return builder(config(name, self.root, self.entries[name]), self.rt)

    def prompt(self, scorer: Any, step: Step) -> str:
        return step.prompt if scorer.kind == "reward" else (step.base_prompt or step.prompt)

    def report(self, label: str, scorer: Any, ref_one: Callable[[Step], Any], floor_s: float, floor_peak: int | None,
               note: str = "") -> None:
        """Time rewardstack (untracked) and the reference; peaks on the heavy step; one row each."""
        tracker = self.rt.memory.tracker
        self.rt.memory.tracker = None  # timings pay no dispatch hook
        t = timed(lambda: [scorer.score(ScoreRequest(self.prompt(scorer, s), s.completions, s.name)) for s in self.steps])
        # The reference runs once: its heavy step inside a tracker window (its peak), the rest bare.
        peaks: list[int] = []
        t_ref = timed(lambda: [peaks.append(peak_of(lambda: ref_one(s))) if s is self.heavy else ref_one(s)
                               for s in self.ref_steps])
        peak_ref = peaks[0]
        self.rt.memory.tracker = tracker
        self.rt.options.get("embedding_cache", embedding.EmbeddingCache()).clear()
        s = self.heavy
        peak = peak_of(lambda: scorer.score(ScoreRequest(self.prompt(scorer, s), s.completions, s.name)))
        n = sum(len(s.completions) for s in self.steps)
        n_ref = sum(len(s.completions) for s in self.ref_steps)
        self.set["ours"] += t
        self.set["ref"] += t_ref * n / n_ref
        self.set["floor"] += floor_s
        self.rows.append([label, f"{n / t:8.1f}", f"{n_ref / t_ref:8.1f}", f"{n / floor_s:8.1f}",
                          f"{t / floor_s:6.2f}x", f"{peak / MiB:8.1f}", f"{peak_ref / MiB:9.1f}",
                          f"{floor_peak / MiB:8.1f}" if floor_peak is not None else "       -", note])
        short, long = text(__import__("random").Random(5), 500), text(__import__("random").Random(6), 40_000)
        self.rt.options.get("embedding_cache", embedding.EmbeddingCache()).clear()
        p500 = peak_of(lambda: scorer.score(ScoreRequest(self.prompt(scorer, s), [short], s.name)))
        p40k = peak_of(lambda: scorer.score(ScoreRequest(self.prompt(scorer, s), [long], s.name)))
        self.flat.append(f"{label:22s} 500 chars {p500 / MiB:7.2f} MiB   40,000 chars {p40k / MiB:7.2f} MiB   "
                         f"ratio {p40k / max(p500, 1):5.1f}x")

    # -- models ---------------------------------------------------------------------------
    def openassistant(self) -> None:
        sc = self.build("rlhf_reward_model", classifier.build_openassistant)
        floor = floors.openassistant(sc, self.steps)
        fp = peak_of(lambda: floors.openassistant(sc, [self.heavy]))
        ref = lambda s: [ref_openassistant(sc.model, sc.tokenizer, s.prompt, c) for c in s.completions if c is not None]
        self.report("openassistant", sc, ref, floor, fp, "reference: no truncation (the 40k pair unbounded)")

    def nsfw(self) -> None:
        sc = self.build("nsfw_filter", classifier.build_nsfw)
        floor = floors.nsfw(sc, self.steps)
        fp = peak_of(lambda: floors.nsfw(sc, [self.heavy]))
        ref = lambda s: [ref_nsfw(sc.model, sc.tokenizer, c) for c in s.completions if c is not None]
        self.report("nsfw", sc, ref, floor, fp)

    def embeddings(self) -> None:
        rel = self.build("relevance_filter", embedding.build_relevance)
        div = self.build("diversity_reward_model", embedding.build_diversity)
        m1, t1, m2, t2 = rel.first.model, rel.first.tokenizer, rel.second.model, rel.second.tokenizer
        b1 = rel.bounds[0]
        cache = self.rt.options["embedding_cache"]
        f_rel, f_div = floors.embeddings(rel, self.steps, cache)
        bert, _, _ = floors.embedding_rows(rel, [self.heavy], cache)
        pooled = embedding.pooled
        fp_rel = peak_of(lambda: floors.forward_rows(m1, bert, rel.first.pad_id, pooled))
        fp_div = peak_of(lambda: floors.forward_rows(m2, t2(floors.live(self.heavy), truncation=True,
                                                            max_length=rel.second.max_length)["input_ids"],
                                                     rel.second.pad_id, pooled))

        def ref_rel(s: Step) -> None:  # the reference: per completion, prompt re-embedded each time
            for c in s.completions:
                if c is None:
                    continue
                e, p = ref_bert_embedding(m1, t1, c), ref_bert_embedding(m1, t1, s.base_prompt)
                if -float(((e - p) ** 2).mean().sqrt()) >= b1:
                    ref_mpnet_embedding(m2, t2, [c]), ref_mpnet_embedding(m2, t2, [s.base_prompt])

        def ref_div(s: Step) -> None:  # the reference embeds the step's completions in one call
            ref_mpnet_embedding(m2, t2, [c for c in s.completions if c is not None])

        # Relevance first, then diversity on the same runtime: diversity pays only what is new.
        self.report("relevance", rel, ref_rel, f_rel, fp_rel, "production bounds; few pass model 1 on the stand-in")
        self.rt.options["embedding_cache"].clear()
        tracker = self.rt.memory.tracker
        self.rt.memory.tracker = None
        for s in self.steps:  # warm the shared cache as the stack would (relevance runs first)
            rel.score(ScoreRequest(s.base_prompt, s.completions, s.name))
        self.rt.memory.tracker = tracker
        self.report("diversity", div, ref_div, max(f_div, 1e-9), fp_div,
                    "marginal: after relevance, MPNet shared (floor: texts not yet embedded)")

    def reciprocate(self) -> None:
        from rewardstack._scorers import reciprocate

        folder = self.root / "reciprocate_reward_model"
        entry = make_reciprocate_standin(folder)
        sc = reciprocate.build(config("reciprocate_reward_model", self.root, entry, weight=1.0), self.rt)
        fmt = reciprocate.TEMPLATE.format
        floor = floors.reciprocate_floor(sc, self.steps)
        heavy = floors.reciprocate_groups(sc, [self.heavy])
        fp = peak_of(lambda: floors.floor_body(sc.body, heavy))

        def ref(s: Step) -> None:
            for c in s.completions:
                if c is not None:
                    inp = sc.tokenizer(fmt(prompt=s.prompt, completion=c), return_tensors="pt", truncation=True)
                    with torch.no_grad():
                        sc.model(**inp)

        self.report("reciprocate", sc, ref, floor, fp, "floor: shared prefix once + suffixes")


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keep the table readable: no load bars or length warnings
    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-steps", type=int, default=3,
                    help="steps the (slow) per-completion reference runs, plus the 40,000-character one")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    steps = heavy_tailed_steps()
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(Path(tmp), steps, max(1, args.ref_steps))
        t0 = time.perf_counter()
        b.openassistant()
        b.reciprocate()
        b.embeddings()
        b.nsfw()
        wall = time.perf_counter() - t0
    n = sum(len(s.completions) for s in steps)
    print(f"\nworkload: {len(steps)} steps x {len(steps[0].completions)} completions, one of 40,000 chars; "
          f"reference over {len(b.ref_steps)} steps (incl. the 40k one); CPU threads {torch.get_num_threads()}")
    head = ["model", "ours c/s", "ref c/s", "floor c/s", "vs floor", "peak MiB", "ref MiB", "floor MiB", "note"]
    print(f"{head[0]:14s} " + " ".join(f"{h:>8s}" for h in head[1:8]) + "  note")
    for r in b.rows:
        print(f"{r[0]:14s} " + " ".join(r[1:8]) + (f"  {r[8]}" if r[8] else ""))
    st = b.set
    print(f"{'whole set':14s} {n / st['ours']:8.1f} {n / st['ref']:8.1f} {n / st['floor']:8.1f} "
          f"{st['ours'] / st['floor']:6.2f}x   (target <= 1.30x of floor; {st['ref'] / st['ours']:.1f}x the reference)")
    print("\npeak tracked memory, one completion per step:")
    for line in b.flat:
        print("  " + line)
    print(f"\nbench wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
