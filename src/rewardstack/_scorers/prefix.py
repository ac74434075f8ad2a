"""Shared-prefix forward passes for the decoder (causal) scorers.

All completions of a step share the step's prompt, so their token id lists share a prefix. A causal
model's hidden states over that prefix do not depend on what follows it, so the prefix is run once
(keeping its keys and values) and every input's remaining tokens are then run in batches attending
to the cached prefix. The numbers equal running each full sequence (within float tolerance).

The common prefix is taken on token ids, never on strings: tokenizing prompt + completion as one
string may merge tokens at the boundary, so the prompt's own tokens are not always a prefix.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from rewardstack._scorers.encoding import model_device, pad_rows
from rewardstack._memory.costmodel import padding_groups


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix common to all `seqs`, leaving each at least one token.

    Every input keeps one token of its own so that its last position is always in the suffix pass
    (a classifier reads it there) and the suffix batch is never empty.
    """
    if not seqs:
        return 0
    shortest = min(len(s) for s in seqs)
    return min(len(os.path.commonprefix([list(s) for s in seqs])), max(0, shortest - 1))


def accepts(module: torch.nn.Module, name: str) -> bool:
    """Whether `module.forward` takes keyword `name` (or any keyword)."""
    params = inspect.signature(module.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def cache_kwarg(body: torch.nn.Module) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name is deprecated)."""
    params = inspect.signature(body.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class PrefixState:
    """The prefix's last hidden states [C, H] and per-layer (keys, values), batch 1."""

    length: int
    hidden: torch.Tensor | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class PrefixRunner:
    """Runs a body (a transformers decoder without its head) over inputs sharing a token prefix.

    `prefix_ids` is computed once per step (e.g. with `common_prefix_len`); the prefix pass itself
    runs lazily on the first `run`, so it happens inside the memory manager's guard and tracker.
    """

    def __init__(self, body: torch.nn.Module, prefix_ids: Sequence[int], *, pad_id: int = 0,
                 prefix_types: Sequence[int] | None = None, whole: bool = True) -> None:
        self.body = body
        # Unpadded long groups run whole (`runs_whole`); False keeps every group on the cache path
        # (the load-time profile, which prices the padded batches scoring runs, mask included).
        self.whole = whole
        self.prefix_ids = list(prefix_ids)
        self.pad_id = pad_id
        # The prefix's token_type_ids, for a scorer whose reference passes the tokenizer's types.
        self.prefix_types = list(prefix_types) if prefix_types is not None else None
        self._state: PrefixState | None = None
        self._kw = cache_kwarg(body)

    @property
    def length(self) -> int:
        """Number of prefix tokens (0: every input is run whole)."""
        return len(self.prefix_ids)

    def state(self) -> PrefixState:
        """The prefix pass's outputs, computed on first use on the body's current device."""
        device = model_device(self.body)
        if self._state is not None and (self._state.hidden is None or self._state.hidden.device == device):
            return self._state
        if not self.prefix_ids:
            self._state = PrefixState(0, None, [])
            return self._state
        ids = torch.tensor([self.prefix_ids], dtype=torch.long, device=device)
        cache = DynamicCache()
        extra = {}
        if self.prefix_types is not None:
            extra["token_type_ids"] = torch.tensor([self.prefix_types], dtype=torch.long, device=device)
        out = self.body(input_ids=ids, use_cache=True, **{self._kw: cache}, **extra)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._state = PrefixState(len(self.prefix_ids), out.last_hidden_state[0], kv)
        return self._state

    def run(self, suffixes: Sequence[Sequence[int]],
            types: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Last hidden states of each input's tokens after the prefix: ([B, S, H], mask [B, S]).

        Inputs are right-padded to the longest suffix; padded positions come after every real
        one, so causal attention keeps them from changing real positions' numbers. `types`: each
        suffix's token_type_ids, passed to the body as `token_type_ids` (None: not passed).
        """
        device = model_device(self.body)
        st = self.state()
        b = len(suffixes)
        s = max(len(x) for x in suffixes)
        if self.whole and runs_whole(st.length, suffixes) and (types is None or self.prefix_types is not None):
            # Prefix and suffix as one causal pass of unpadded rows, no cache: no mask is built.
            whole = PrefixRunner(self.body, [], pad_id=self.pad_id).run(
                [self.prefix_ids + list(x) for x in suffixes],
                [self.prefix_types + list(t) for t in types] if types is not None else None)  # type: ignore[operator]
            return whole[0][:, st.length :], whole[1][:, st.length :]
        ids, mask = pad_rows(suffixes, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        kwargs: dict = {}
        if st.length:
            # Expanded views: the cache's concatenation makes the only per-row copy.
            kwargs[self._kw] = DynamicCache(
                ddp_cache_data=[(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in st.kv]
            )
            kwargs["use_cache"] = True
        elif accepts(self.body, "use_cache"):  # some remote-code models have no use_cache
            kwargs["use_cache"] = False
        # Without padding no mask is needed, which lets attention use its causal fast path.
        prefix_mask = torch.ones((b, st.length), dtype=torch.long, device=device)
        attn = None if bool(mask.all()) else torch.cat([prefix_mask, mask], dim=1)
        if accepts(self.body, "position_ids"):  # ALiBi models may not take them
            kwargs["position_ids"] = torch.arange(st.length, st.length + s, device=device).unsqueeze(0).expand(b, -1)
        if types is not None:
            kwargs["token_type_ids"] = pad_rows(types, 0, width=s)[0].to(device)
        out = self.body(input_ids=ids, attention_mask=attn, **kwargs)
        return out.last_hidden_state, mask.bool()

    def rows(self, suffix_hidden: torch.Tensor, index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states at absolute `positions` of inputs `index` (in the batch), prefix or suffix.

        A position before the prefix's end is read from the prefix pass (the same for every input);
        the others from the suffix pass at `position - prefix length`.
        """
        st = self.state()
        c = st.length
        in_suffix = positions >= c
        out = suffix_hidden[index, (positions - c).clamp(min=0)]
        if c and not bool(in_suffix.all()):
            pre = st.hidden[positions.clamp(max=c - 1)]
            out = torch.where(in_suffix.unsqueeze(-1), out, pre)
        return out


def runs_whole(prefix_len: int, suffixes: Sequence[Sequence[int]]) -> bool:
    """Whether `PrefixRunner.run` runs these suffixes whole (prefix included) instead of through the cache.

    Through a cache the suffix's queries sit `prefix_len` positions after the first key, so
    transformers cannot use attention's causal fast path and builds the whole causal mask
    [B, 1, S, C + S] as booleans, which sdpa converts to floats: 5 bytes a cell, 320 MiB for one
    8,192-token completion after a 9-token prompt (measured 2026-12-01), inside the kernel where the
    tracker does not see it. Without padding and without a cache the fast path needs no mask. So
    a group whose suffixes all have one length, at least `WHOLE_RATIO` times the prefix's, runs
    whole: recomputing the prefix costs at most an eighth of the suffix. The ratio also keeps the
    cost model's prediction honest: batches are planned with the prefix counted as cached
    (`CostModel.predict(prefix=)`), and a whole pass holds at most 1/8 more positions than the
    suffix it was predicted for, within the planner's margin (0.9), where a suffix as short as
    the prefix would double them. A padded group needs its mask either way.
    """
    return (prefix_len > 0 and len({len(x) for x in suffixes}) == 1
            and len(suffixes[0]) >= WHOLE_RATIO * prefix_len)


WHOLE_RATIO = 8
"""How many times the shared prefix an unpadded suffix must be to run whole (`runs_whole`)."""


def split_prefix(seqs: Sequence[Sequence[int]], enabled: bool = True) -> tuple[list[int], list[list[int]]]:
    """(common prefix ids, each input's remaining ids) for a group of inputs."""
    c = common_prefix_len(seqs) if enabled else 0
    prefix = list(seqs[0][:c]) if seqs else []
    return prefix, [list(s[c:]) for s in seqs]


def dummy_ids(vocab: int, batch: int, length: int) -> list[list[int]]:
    """Seeded random token ids of shape (batch, length), for the profile runs at load."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0)).tolist()


def profile_runner(body: torch.nn.Module, ids: list[list[int]], *, enabled: bool, pad_id: int = 0,
                   prefix: int = 1) -> PrefixRunner:
    """The runner of a load-time profile pass: the path scoring takes, prefix cache included.

    Every row of `ids` is made to share its first token, which runs as the prefix; the rest runs
    as the suffix pass, whose keys and values are concatenated per row onto the prefix's and kept
    for every layer. For a given total length this is the largest the cached path gets (a longer
    prefix only shortens the suffix; the prefix's own keys and values are live before a step's
    batches are planned, see `MemoryManager.run(prepare=)`). `enabled` False: no prefix, as
    scoring runs then. `prefix`: share that many first tokens instead (at most all but one), the
    profile of a pass after a long shared prompt (`CostModel.fit_prefix`).
    """
    if not enabled or not ids or len(ids[0]) < 2:
        return PrefixRunner(body, [], pad_id=pad_id)
    p = max(1, min(int(prefix), len(ids[0]) - 1))
    for row in ids:
        row[:p] = ids[0][:p]
    # Its rows are all one length: kept on the cache path, as a padded scoring batch runs.
    return PrefixRunner(body, ids[0][:p], pad_id=pad_id, whole=False)


def run_in_groups(batch: list[int], lengths: Sequence[int], run: Callable[[list[int]], Sequence[float]]) -> list[float]:
    """`run(indices)` on each padding group of `batch` (`lengths[j]` per index); values in batch order."""
    out = [math.nan] * len(batch)
    for group in padding_groups([lengths[j] for j in batch]):
        for g, v in zip(group, run([batch[g] for g in group])):
            out[g] = v
    return out

