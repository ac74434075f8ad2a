"""Exact blocked attention for remote-code models whose own attention builds [heads, L, L] scores.

BTLM's remote code (cerebras/btlm-3b-8k-base `modeling_btlm.py`, transcribed by
`rewardstack._planning.btlm`) builds, once per forward, the ALiBi bias of every head against every
key (`relative_pe(q, k)`: `[heads, L, L]` float32) and in every layer the scores, their float32
softmax and its cast: at 8,192 tokens and 32 heads each float32 one is 8 GiB. Attention is
row-wise, so none of that is needed at once: this module runs the model's own operations (scores
`q @ k^T`, divided by `d ** attn_scale_power` (muP: 1/d), the causal mask by `where` with the
dtype's minimum, the additive padding mask, the ALiBi bias `-slope * |k - q|` formed in float32
and cast to the scores' dtype, softmax in float32, cast to V's dtype, product with V) on blocks of
at most `rows` query rows against all keys. Each block's numbers are the model's numbers for those
rows (the same ops in the same order and dtypes; in-place forms of the same ops round the same), so
no tensor of `heads x L x L` is ever alive: per layer the largest is `heads x rows x L` float32.

How it reaches the loaded model: a verified replacement at load (`install`). The body's
`relative_pe` module is replaced by `LazyAlibi` (it returns an `AlibiBias` that builds rows on
demand instead of the full bias) and each block's `attn` by `BlockedAttention`; both adopt the
original modules' parameters, buffers and children under the same names, so the state dict,
the weights' bytes and placement's moves are unchanged. Before the replacement stays, the body
runs a probe input (a padded batch, longer than several probe blocks with an uneven last one)
through its own attention and through the blocked one; only when the last hidden states agree
within `PROBE_TOLERANCE` of the dtype is the replacement kept. Otherwise the originals are put
back, the reason is logged, and the scorer plans with the model's own cost. Remote code is
downloaded text that may differ from our transcription: the probe, not a name, decides.

Why not a native BTLM module with no remote code: it would need its own weight-name mapping and
parity story for every checkpoint revision, and would still have to match the remote code that the
reference ran. Why not torch's `scaled_dot_product_attention` with a bias block: its float16 path
does not form the scores and softmax in the remote code's dtypes, and the float32 bias block it
needs is the same size as the blocked scores, so it saves no memory here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("rewardstack.attention")

ATTENTION_BLOCK = 512  # query rows per block by default (the budget may lower it; see dpo_chunks)
MIN_BLOCK = 16
PROBE_LENGTH = 40  # tokens: with PROBE_BLOCK rows per block, two whole blocks and an uneven last one
PROBE_BLOCK = 16
# Relative norm of (blocked - own) / own over the probe's valid rows: rounding only. float16's is
# the float16 tolerance docs/SEMANTICS.md states for scores.
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class AlibiBias:
    """The `[heads, q, k]` ALiBi bias `-slope * |key pos - query pos|`, built a block of rows at a time.

    Query row i sits at position `k - q + i` (the last q of k positions), as the remote code's
    `relative_pe` places it.
    """

    def __init__(self, slopes: torch.Tensor, q_len: int, k_len: int) -> None:
        self.slopes, self.q_len, self.k_len = slopes, int(q_len), int(k_len)
        self._whole: torch.Tensor | None = None  # all rows, kept when one block covers them

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1-1 of the bias in the slopes' dtype, as the model's layer forms it.

        When one block covers every row (short inputs) the bias is built once and shared by every
        layer, as the model's own is: no more memory than its own, and no work per layer.
        """
        if r0 == 0 and r1 == self.q_len:
            if self._whole is None:
                self._whole = self._build(0, self.q_len)
            return self._whole
        return self._build(r0, r1)

    def _build(self, r0: int, r1: int) -> torch.Tensor:
        dev = self.slopes.device
        off = self.k_len - self.q_len
        context = torch.arange(off + r0, off + r1, device=dev)[:, None]
        memory = torch.arange(self.k_len, device=dev)[None, :]
        relative = torch.abs(memory - context)
        return self.slopes.reshape(-1, 1, 1) * -1.0 * relative.unsqueeze(0)


def _adopt(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """Give `new` the parameters, buffers and children of `old` under the same names (same objects)."""
    for n, p in old.named_parameters(recurse=False):
        new.register_parameter(n, p)
    persistent = {n for n, _ in old.state_dict(keep_vars=True).items() if "." not in n}
    for n, b in old.named_buffers(recurse=False):
        new.register_buffer(n, b, persistent=n in persistent)
    for n, c in old.named_children():
        new.add_module(n, c)


class LazyAlibi(torch.nn.Module):
    """Stands in for the body's `relative_pe`: returns an `AlibiBias` instead of the full tensor."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        _adopt(self, original)
        if "slopes" not in dict(self.named_parameters(recurse=False)) and "slopes" not in dict(self.named_buffers(recurse=False)):
            self.register_buffer("slopes", original.slopes, persistent=False)  # a plain attribute there

    def forward(self, seq_length: int, key_length: int, cached_qk_len: int | None = None) -> AlibiBias:
        # The stand-in's signature is (q, past + q); the hub code's is (q, q, past).
        k = int(key_length) + (int(cached_qk_len) if cached_qk_len is not None else 0)
        return AlibiBias(self.slopes, int(seq_length), k)


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, divisor: float | None,
                      layer_divisor: float | None, attention_mask: torch.Tensor | None,
                      bias: AlibiBias | torch.Tensor | None, rows: int) -> torch.Tensor:
    """softmax(scores) @ V over blocks of at most `rows` query rows: [B, H, q, d] in V's dtype.

    The scores of a block, in the query's dtype: `q @ k^T`, `/ divisor` (the model's `d ** power`
    as a 0-d tensor of that dtype), `/ layer_divisor` (GPT-2's optional per-layer scale), causal
    positions kept and the rest set to the dtype's minimum, `+ attention_mask`, `+ bias` cast to
    the scores' dtype; then softmax in float32, cast to V's dtype, times V.
    """
    b, h, q_len, _ = query.shape
    k_len = key.shape[-2]
    step = max(1, int(rows))
    out = torch.empty(b, h, q_len, value.shape[-1], dtype=value.dtype, device=value.device) if q_len > step else None
    kt = key.transpose(-1, -2)
    dt = query.dtype
    div = torch.full([], divisor, dtype=dt, device=query.device) if divisor is not None else None
    mask_value = torch.finfo(dt).min
    for r0 in range(0, q_len, step):
        r1 = min(q_len, r0 + step)
        w = torch.matmul(query[:, :, r0:r1], kt)
        if div is not None:
            w.div_(div)
        if layer_divisor is not None:
            w.div_(layer_divisor)
        # Row r0 + i keeps keys j <= r0 + i + (k - q): the remote code's tril(k - q), those rows of it.
        causal = torch.ones((r1 - r0, k_len), dtype=torch.bool, device=query.device).tril(k_len - q_len + r0)
        w.masked_fill_(~causal, mask_value)
        del causal
        if attention_mask is not None:
            w = w.add_(attention_mask) if attention_mask.dtype == w.dtype else w + attention_mask
        if bias is not None:
            blk = bias.rows(r0, r1) if isinstance(bias, AlibiBias) else bias[:, r0:r1]
            w.add_(blk.unsqueeze(0).to(w.dtype))
            del blk
        p = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32)  # == softmax(w.float())
        del w
        p = p.type(value.dtype)
        if out is None:  # one block: its product is the output (no copy)
            return torch.matmul(p, value)
        out[:, :, r0:r1] = torch.matmul(p, value)
        del p
    return out


class BlockedAttention(torch.nn.Module):
    """Stands in for one block's `attn`: the model's projections, its attention in row blocks.

    Takes the keywords the remote code's block passes (hidden states, `layer_past` as a (key,
    value) tuple, `attention_mask`, `position_bias`, `use_cache`; the hub code's `head_mask` and
    `output_attentions` too) and returns `(output, present)` as the original does.
    """

    def __init__(self, original: torch.nn.Module, choice: AttentionChoice) -> None:
        super().__init__()
        _adopt(self, original)
        self.block = choice  # its `rows`, shared by every blocked layer of the model, the budget may lower
        self.embed_dim = int(original.embed_dim)
        self.num_heads = int(original.num_heads)
        self.head_dim = int(getattr(original, "head_dim", self.embed_dim // self.num_heads))
        self.scale_attn_weights = bool(getattr(original, "scale_attn_weights", True))
        self.attn_scale_power = float(getattr(original, "attn_scale_power", 0.5))
        by_layer = bool(getattr(original, "scale_attn_by_inverse_layer_idx", False))
        self.layer_divisor = float(getattr(original, "layer_idx", 0) + 1) if by_layer else None

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, layer_past: Any = None, attention_mask: torch.Tensor | None = None,
                position_bias: Any = None, use_cache: bool = False, head_mask: Any = None,
                output_attentions: bool = False, **_: Any) -> tuple[torch.Tensor, Any]:
        if output_attentions or head_mask is not None:
            raise ValueError("blocked attention keeps no attention weights and takes no head mask "
                             "(set the scorer's option attention = \"own\")")
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split(query), self._split(key), self._split(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        divisor = value.size(-1) ** self.attn_scale_power if self.scale_attn_weights else None
        out = blocked_attention(query, key, value, divisor=divisor, layer_divisor=self.layer_divisor,
                                attention_mask=attention_mask, bias=position_bias, rows=self.block.rows)
        b, _, q_len, _ = out.shape
        out = out.permute(0, 2, 1, 3).reshape(b, q_len, self.embed_dim)
        out = self.c_proj(out)
        if hasattr(self, "resid_dropout"):
            out = self.resid_dropout(out)
        return out, present


@dataclass
class AttentionChoice:
    """Which attention a model runs, and why; its blocked layers read `rows` from it."""

    kind: str  # "blocked" or "own"
    reason: str = ""
    rows: int | None = None
    """Query rows per block (None: the model's own attention)."""
    replaced: list[tuple[torch.nn.Module, str, torch.nn.Module]] = field(default_factory=list)

    def set_rows(self, rows: int) -> None:
        """Use `rows` query rows per block from the next forward on (no effect on own attention)."""
        if self.rows is not None:
            self.rows = max(1, int(rows))

    def describe(self) -> str:
        """One phrase for the operator log and `rewardstack plan`."""
        if self.kind == "blocked":
            return f"blocked ALiBi attention, {self.rows}-row query blocks"
        return f"the model's own attention ({self.reason})" if self.reason else "the model's own attention"

    def restore(self) -> None:
        """Put the model's own modules back."""
        for parent, name, original in reversed(self.replaced):
            setattr(parent, name, original)
        self.replaced.clear()
        self.kind, self.rows = "own", None


def sites(body: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module, str]], str]:
    """The attention modules of a BTLM-like body (GPT-2 layout, `relative_pe` with ALiBi slopes), or why not.

    Returns ([(block, "attn"), ...], "") when every layer has the projections blocked attention
    needs, else ([], reason).
    """
    pe = getattr(body, "relative_pe", None)
    layers = getattr(body, "h", None)
    if pe is None or not isinstance(getattr(pe, "slopes", None), torch.Tensor):
        return [], "no ALiBi relative_pe with slopes (attention builds no L x L bias)"
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return [], "no GPT-2 layer list `h`"
    out = []
    for i, block in enumerate(layers):
        attn = getattr(block, "attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("c_attn", "c_proj", "num_heads", "embed_dim")):
            return [], f"layer {i} has no GPT-2 attention (c_attn, c_proj, num_heads, embed_dim)"
        if getattr(attn, "is_cross_attention", False):
            return [], f"layer {i} is cross-attention"
        out.append((block, "attn"))
    return out, ""


def _run(body: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from rewardstack._scorers.prefix import accepts

    kwargs = {"use_cache": False} if accepts(body, "use_cache") else {}
    with torch.inference_mode():
        return body(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state


def install(name: str, body: torch.nn.Module, *, rows: int = ATTENTION_BLOCK, verify: bool = True,
            vocab: int | None = None, wanted: bool = True) -> AttentionChoice:
    """Replace `body`'s attention by the blocked one when it applies and (if `verify`) agrees.

    `verify=False` installs without the probe (the meta-device simulation, which has no values to
    compare); `wanted=False` (the scorer's option `attention = "own"`) keeps the model's own. The
    choice is logged under `rewardstack.attention` with its reason.
    """
    where, why = sites(body) if wanted else ([], 'attention = "own" in the config')
    if where and verify:
        device = next(body.parameters()).device
        vocab = vocab or int(body.get_input_embeddings().weight.shape[0])
        ids = torch.randint(0, vocab, (2, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, PROBE_LENGTH, dtype=torch.long)
        mask[1, PROBE_LENGTH - 7:] = 0  # a right-padded row: the padding mask's path is checked too
        ids, mask = ids.to(device), mask.to(device)
        try:
            own_out = _run(body, ids, mask)
        except Exception as e:  # noqa: BLE001 - the model's own pass failing leaves it as it is
            where, why = [], f"load probe: own attention raised {type(e).__name__}: {e}"
    if not where:
        choice = AttentionChoice("own", why)
        log.info("%s: %s", name, choice.describe())
        return choice
    choice = AttentionChoice("blocked", rows=PROBE_BLOCK if verify else max(1, int(rows)))
    choice.replaced.append((body, "relative_pe", body.relative_pe))
    body.relative_pe = LazyAlibi(body.relative_pe)
    for parent, attr in where:
        choice.replaced.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, BlockedAttention(getattr(parent, attr), choice))
    if verify:
        try:
            new_out = _run(body, ids, mask)
            valid = mask.bool()
            a, b = own_out[valid].float(), new_out[valid].float()
            err = float((a - b).norm() / a.norm().clamp(min=1e-12))
        except Exception as e:  # noqa: BLE001
            err, why = float("nan"), f"{type(e).__name__}: {e}"
        else:
            why = f"relative difference {err:.2g}"
        choice.rows = max(1, int(rows))
        tol = PROBE_TOLERANCE.get(own_out.dtype, 1e-2)
        if not err <= tol:  # also NaN
            choice.restore()
            choice.reason = f"load probe: blocked attention differs from the model's own ({why}, tolerance {tol:g})"
            log.warning("%s: %s", name, choice.describe())
            return choice
        choice.reason = f"load probe agrees: {why}"
    log.info("%s: %s (%s)", name, choice.describe(), choice.reason or "installed without a probe")
    return choice


def block_rows_of(model: torch.nn.Module) -> AttentionChoice | None:
    """The choice whose `rows` a model's blocked layers share (None: it runs its own attention)."""
    for m in model.modules():
        if isinstance(m, BlockedAttention):
            return m.block
    return None


def attention_of(model: torch.nn.Module) -> str:
    """A short name of the attention a (meta or loaded) model runs: blocked, sdpa, eager or own."""
    for m in model.modules():
        if isinstance(m, BlockedAttention):
            return f"blocked({m.block.rows})"
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if getattr(model, "_supports_sdpa", False) and impl in ("sdpa", "eager") else "own"
