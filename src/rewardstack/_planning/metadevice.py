"""The simulated device: the tracker on meta tensors, fused attention pinned, the largest allocation.

`measure_meta(run, modules, full=...)` runs a pass on the meta device under `SimTracker` and gives
its peak above what was live before, with the largest single allocation and the module that made it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from rewardstack._memory.device import TensorBytesTracker, storage_of, tensors_in
from rewardstack._planning.archs import SimulationError


class SimTracker(TensorBytesTracker):
    """The tensor-bytes tracker, also recording the largest single allocation and where it was made."""

    def __init__(self, budget_bytes: int | None = None, *, full: bool = True) -> None:
        super().__init__(budget_bytes)
        self.largest = (0, "", (), "")  # bytes, op, shape, module
        self.module_stack: list[str] = []
        self.full = full  # the answer to "is this bool mask all true?" (see `_answer`)
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return _answer(self, func, args[0])  # one mode, not two: every op pays for each mode
        inputs = {id(s) for s in map(storage_of, tensors_in((args, kwargs or {}))) if s is not None}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tensors_in(out):
            st = storage_of(t)
            if st is not None and id(st) not in inputs and st.nbytes() > self.largest[0]:
                where = self.module_stack[-1] if self.module_stack else ""
                self.largest = (int(st.nbytes()), str(func), tuple(t.shape), where)
        return out


_VALUE_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default)


def _answer(mode: Any, func: Any, t: torch.Tensor) -> bool:
    """The one value a forward pass reads from a meta tensor: whether a bool is all true.

    transformers asks `attention_mask.all()` to skip building a mask when nothing is padded, and
    the prefix runner asks the same of its batch; the answer follows from the lengths, which the
    simulation knows (`mode.full`). Any other read of a value is an error naming the op.
    """
    if t.dtype == torch.bool:
        mode.answered += 1
        return mode.full
    raise SimulationError(f"the simulated pass reads a {t.dtype} value from a meta tensor ({func})")


_SDPA_LOCK = threading.Lock()


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Scaled-dot-product attention on meta tensors as the fused kernel runs it (no L x L scores)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    with _SDPA_LOCK:
        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _module_names(tracker: SimTracker, modules: tuple[torch.nn.Module, ...]) -> Iterator[None]:
    """Record the qualified name of the module running, for naming the largest allocation."""
    names = {id(m): n for root in modules for n, m in root.named_modules() if n}
    stack = tracker.module_stack

    def pre(mod: torch.nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), stack[-1] if stack else ""))

    def post(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def measure_meta(run: Callable[[], Any], modules: tuple[torch.nn.Module, ...], *, full: bool) -> tuple[int, tuple]:
    """Peak bytes above the start of `run()` on meta tensors, and the largest allocation in it."""
    tracker = SimTracker(full=full)  # also answers the mask reads (`_answer`)
    with torch.inference_mode(), _fused_attention(), _module_names(tracker, modules):
        with tracker.window("simulate") as w:
            run()
    return w.peak_increase, tracker.largest
