"""One pass per scorer family on meta tensors, built from the scorers' own code.

Each `*_pass(...)` returns a function that runs the family's forward pass at the given shapes (the
encoders through `encoding.pad_batch` and the scorer's head; the decoders through `PrefixRunner`;
DPO through the scorer's `chunked_logprobs` in shape-only mode, with the scorer's blocked
attention where it installs it; the judge as transformers' greedy
loop runs it), for `metadevice.measure_meta` to measure.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rewardstack._models import resolve, spec


# -- one pass per scorer family, on meta tensors -------------------------------------------------

def rows_of(batch: int, length: int, padded: bool, fill: int = 5) -> list[list[int]]:
    """Token-id rows of the rectangle; padded: the last row one token short (so padding exists)."""
    rows = [[fill] * length for _ in range(batch)]
    if padded and batch > 1 and length > 1:
        rows[-1] = rows[-1][:-1]
    return rows


def encoder_pass(model: str, mods: tuple, rows: list[list[int]], pair: bool) -> Callable[[], Any]:
    from rewardstack._scorers import encoding as enc

    m = mods[0]
    head = resolve(spec(model).simulated.head)  # the scorer's own function
    types = [[0] * len(r) for r in rows] if pair else None

    def run() -> Any:
        # As `encoding.rows_pass` builds a pass; pad_batch moves the ids to the model's device (meta here).
        batch = {k: v.to("meta") for k, v in enc.pad_batch(m, rows, 0, types).items()}
        return head(m(**batch), batch["attention_mask"]).float()

    return run


def _prefix_runner(body: torch.nn.Module, prefix: int, fill: int = 5) -> Any:
    from rewardstack._scorers.prefix import PrefixRunner

    return PrefixRunner(body, [fill] * prefix, pad_id=0)


def decoder_pass(body: torch.nn.Module, head: torch.nn.Module, rows: list[list[int]], prefix: int) -> Callable[[], Any]:
    """Reciprocate's and Dahoas's pass (`ReciprocateScorer._forward`, `DahoasScorer._forward`): the
    shared prefix, the suffixes, then the head on each row's last position."""

    def run() -> Any:
        runner = _prefix_runner(body, prefix)
        h, _ = runner.run([r[runner.length:] for r in rows])
        last = torch.tensor([len(r) - 1 for r in rows]).to("meta")
        out = head(runner.rows(h, torch.arange(len(rows), device="meta"), last))[:, 0].float()
        return runner, out

    return run


def _meta_logit_head(lm_head: torch.nn.Module, scale: float) -> Any:
    """`dpo.LogitHead` without its weight-norm bound (which reads values): same `__call__`."""
    from rewardstack._scorers.dpo import LogitHead

    head = object.__new__(LogitHead)
    head.weight = lm_head.weight
    head.bias = getattr(lm_head, "bias", None)
    head.scale = float(scale)
    head.vocab = int(lm_head.weight.shape[0])
    head.dtype = lm_head.weight.dtype
    head._wmax, head._bmax = 1.0, 0.0
    return head


def dpo_pass(mods: tuple, rows: list[list[int]], prefix: int, prompt: int, chunk: int,
             block: int | None = None) -> Callable[[], Any]:
    from rewardstack._scorers import dpo  # the scorer's numerics (`dpo_numerics`), as the scorer names them
    from rewardstack._scorers.attention import ATTENTION_BLOCK, block_rows_of

    model = mods[0]
    shared = block_rows_of(model)
    if shared is not None:  # blocked attention: the scorer's query rows per block
        shared.rows = int(block or ATTENTION_BLOCK)
    body, lm_head = model.base_model, model.get_output_embeddings()
    head = _meta_logit_head(lm_head, dpo.logits_scale(model))
    lengths = [len(r) for r in rows]
    plens = [max(1, min(prompt, n - 1)) for n in lengths]

    def run() -> Any:
        runner = _prefix_runner(body, prefix)  # DpoScorer._forward
        h, _ = runner.run([r[runner.length:] for r in rows])
        hidden_at = lambda s, p: runner.rows(h, s, p)  # noqa: E731
        # The scorer's own bookkeeping in shape-only mode: sizes that need values come from the rows
        # per sequence (and are bounded: every scored token distinct).
        b, long = len(rows), torch.long
        ids = torch.empty(b, max(lengths), dtype=long, device="meta")
        plens_t = torch.empty(b, dtype=long, device="meta")
        lens_t = torch.empty(b, dtype=long, device="meta")
        shapes = dpo.PenaltyShapes([n - p for n, p in zip(lengths, plens)], head.vocab, chunk)
        dpo.chunked_logprobs(hidden_at, head, ids, plens_t, lens_t, chunk, shapes)
        return runner

    return run


def judge_pass(mods: tuple, rows: list[list[int]], new_tokens: int = 2) -> Callable[[], Any]:
    from transformers import DynamicCache

    from rewardstack._scorers.prefix import cache_kwarg

    model = mods[0]
    b, width = len(rows), max(len(r) for r in rows)

    def run() -> Any:
        # JudgeScorer.generate: left-padded ids and mask, moved to the device.
        ids = torch.empty(b, width, dtype=torch.long).to("meta")
        mask = torch.empty(b, width, dtype=torch.long).to("meta")
        cache = DynamicCache()
        out_ids = ids
        for step in range(new_tokens):  # transformers' greedy loop, modelled
            pos = mask.long().cumsum(-1) - 1
            pos = pos.masked_fill(mask == 0, 1)
            step_ids = out_ids if step == 0 else out_ids[:, -1:]
            step_pos = pos if step == 0 else pos[:, -1:]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                        logits_to_keep=1, **{cache_kwarg(model): cache})
            logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            nxt = torch.argmax(logits, dim=-1)
            del out, logits
            out_ids = torch.cat([out_ids, nxt[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((b, 1))], dim=-1)
        return cache, out_ids

    return run
