"""Which path a decoder scorer takes: transformers' cache objects, or full sequences.

DPO, Reciprocate, Dahoas and the judge need nothing from a model but its hidden states or logits.
The shared-prefix pass (`prefix.py`) and `generate` reuse keys and values through transformers'
cache objects (`DynamicCache`), which only models written for them take. Remote code written for
transformers 4.x (cerebras/btlm-3b-8k-base among them) indexes `past_key_values` as a tuple of
per-layer tuples: given a cache object it raises, or worse, ignores it and computes the suffix
without the prefix. So at load each scorer runs `takes_cache_objects`: one short sequence run whole,
then run as prefix + suffix through a `DynamicCache`; the model is on the fast path only if that
runs and the suffix's hidden states equal the whole run's. Otherwise the scorer runs full sequences
(still batched by the planner, padded in groups, logits chunked), and its load-time profile runs
on that same path. The decision is logged.

`greedy_tokens` is the judge's cache-free generation: each new token recomputes the whole
left-padded sequence, with the position ids `generate` would give it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rewardstack._scorers.prefix import PrefixRunner, accepts, dummy_ids, model_device

log = logging.getLogger("rewardstack.kvcache")

PROBE_LENGTH = 8  # tokens: 6 of prefix through the cache, 2 after it
PROBE_TOLERANCE = 1e-2  # relative (norm of the difference / norm of the whole run): rounding only


def takes_cache_objects(body: torch.nn.Module, vocab: int) -> tuple[bool, str]:
    """(whether `body` runs a prefix through a DynamicCache correctly, why not if it does not).

    `body` is a decoder without its head (its output has `last_hidden_state`). The check is
    numeric, so a model that silently ignores the cache object is caught as well as one that
    raises on it.
    """
    ids = dummy_ids(vocab, 1, PROBE_LENGTH)[0]
    cut = PROBE_LENGTH - 2
    device = model_device(body)
    try:
        with torch.inference_mode():
            whole = body(input_ids=torch.tensor([ids], device=device), use_cache=False).last_hidden_state[0, cut:]
            suffix, _ = PrefixRunner(body, ids[:cut]).run([ids[cut:]])
    except Exception as e:  # noqa: BLE001 - any failure means: not this path
        return False, f"{type(e).__name__}: {e}"
    whole, suffix = whole.float(), suffix[0].float()
    err = float((suffix - whole).norm() / whole.norm().clamp(min=1e-12))
    if not err <= PROBE_TOLERANCE:  # also catches NaN
        return False, f"the suffix run through the cache differs from the whole run (relative {err:.2g})"
    return True, ""


def choose_path(name: str, body: torch.nn.Module, vocab: int, *, wanted: bool = True) -> bool:
    """True for the cache path, False for full sequences; logs the choice and the reason.

    `wanted=False` (the scorer's option turned off) skips the probe and takes full sequences.
    """
    if not wanted:
        log.info("%s: full sequences (cache path turned off in the config)", name)
        return False
    ok, why = takes_cache_objects(body, vocab)
    if ok:
        log.info("%s: shared-prefix KV cache (the model takes transformers cache objects)", name)
    else:
        log.info("%s: full-sequence fallback, no KV cache reuse (load probe: %s)", name, why)
    return ok


def greedy_tokens(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                  pad_id: int) -> torch.Tensor:
    """Greedy continuation of left-padded `ids` [B, L] without any cache: [B, new_tokens].

    Each step runs the whole sequence so far (`use_cache=False`) and takes the argmax of the last
    position's logits, as `generate(do_sample=False)` does; position ids are the mask's running
    count minus one (1 on padding), which is what `generate` passes for left-padded rows. A row
    that produced the eos token keeps getting `pad_id`, as `generate` pads finished rows. No logits
    processor runs: this reproduces `generate` for a generation config that sets none (a checkpoint
    whose generation_config.json sets, say, a repetition penalty would differ).
    """
    kwargs: dict[str, Any] = {}
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    takes_pos = accepts(model, "position_ids")
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
    out = []
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    with torch.inference_mode():
        for _ in range(new_tokens):
            if takes_pos:
                kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
            logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits[:, -1]
            nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            if eos_ids:
                done = done | torch.isin(nxt, torch.tensor(sorted(eos_ids), device=ids.device))
            out.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(out, dim=1)
