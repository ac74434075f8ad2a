"""Swaps from pinned host memory on a side CUDA stream (CUDA-only; `Placement` uses it on a card).

A swapped model's weights keep one copy in page-locked (pinned) host memory for as long as the
stack runs. Moving a model in allocates its device tensors on the current stream, then copies the
host bytes on a side stream with `non_blocking`: the copy overlaps whatever the current stream is
running (the pass of the model already on the card) and the host does not wait for it. The
consumer waits on the copy's event before its pass (`ready`). Moving a model out points its
tensors back at their host copies: weights are never written, so nothing is copied back.

Pageable `.to()`, the stack's move before this, ran 0.5-6 GB/s on an H200 and blocks the host; a
pinned copy on a side stream ran 52-55 GB/s there (docs/GPU.md). The pinned bytes are host memory
that the OS cannot page out: `rewardstack plan` counts them (`Placement.host_bytes`). torch's pinned
allocator rounds every allocation up to a power of two (a 117 MB projection would take 128 MiB),
so a module's copies are packed into slabs of `SLAB` bytes (`slab_layout`), and the plan counts
the slabs as the allocator rounds them (`pinned_footprint`).
"""

from __future__ import annotations

import torch

SLAB = 1 << 30
"""Bytes of one pinned slab (a power of two: the allocator rounds nothing of a full one)."""
ALIGN = 512
"""Each copy's offset in its slab is a multiple of this (any dtype's alignment)."""


def slab_layout(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors of `sizes` bytes packed first-fit into slabs of `SLAB` bytes (one larger than a slab
    alone in its own): each slab's bytes, and each tensor's (slab, offset)."""
    used: list[int] = []
    where: list[tuple[int, int]] = []
    for n in sizes:
        n = -(-n // ALIGN) * ALIGN
        k = next((i for i, u in enumerate(used) if u + n <= SLAB), len(used))
        if k == len(used):
            used.append(0)
        where.append((k, used[k]))
        used[k] += n
    return used, where


def pinned_footprint(sizes: list[int]) -> int:
    """Host bytes the pinned copies of tensors of `sizes` bytes take: their slabs, each rounded up
    to a power of two as torch's pinned allocator rounds it."""
    return sum(1 << max(0, (u - 1).bit_length()) for u in slab_layout(sizes)[0] if u)


def tensor_bytes(module: torch.nn.Module) -> list[int]:
    """Bytes of each distinct tensor of `module` (meta tensors included: the plan's)."""
    return [t.numel() * t.element_size() for t in module_tensors(module)]


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each distinct parameter and buffer of `module` (a tied tensor once)."""
    seen: set[int] = set()
    out = []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class PinnedSwapper:  # pragma: no cover - CUDA-only (tests/test_pinned_swaps.py, marked gpu)
    """Moves modules between pinned host copies and a CUDA device, copying on a side stream."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"PinnedSwapper is CUDA-only, not {self.device}")
        self.stream = torch.cuda.Stream(self.device)
        self._host: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # id(module) -> (tensor, pinned copy)
        self._events: dict[int, torch.cuda.Event] = {}  # id(module) -> its pending copy's end
        self._slab_bytes = 0

    def pinned_bytes(self) -> int:
        """Host bytes of the pinned slabs this swapper allocated (as the allocator rounds them)."""
        return self._slab_bytes

    def pin(self, module: torch.nn.Module) -> None:
        """Give every tensor of `module` a pinned host copy (once), packed in slabs: a host tensor
        then points at its copy; one on the device is copied down and stays on the device. Tensors
        pinned already (by another swapper) are their own copies."""
        if id(module) in self._host:
            return
        tensors = module_tensors(module)
        if all(t.device.type == "cpu" and t.is_pinned() for t in tensors):
            self._host[id(module)] = [(t, t.data) for t in tensors]
            return
        sizes = [t.numel() * t.element_size() for t in tensors]
        used, where = slab_layout(sizes)
        slabs = [torch.empty(u, dtype=torch.uint8, pin_memory=True) for u in used]
        self._slab_bytes += pinned_footprint(sizes)
        pairs = []
        for t, n, (k, offset) in zip(tensors, sizes, where):
            host = slabs[k][offset:offset + n].view(t.dtype).view(t.shape)
            host.copy_(t.data, non_blocking=True)
            pairs.append((t, host))
        torch.cuda.current_stream(self.device).synchronize()  # the copies down are complete
        for t, host in pairs:
            if t.device.type == "cpu":
                t.data = host
        self._host[id(module)] = pairs

    def to_device(self, module: torch.nn.Module, *, wait: bool = True) -> None:
        """Start copying `module`'s weights onto the device on the side stream. `wait`: the current
        stream waits for the copy (`ready`); otherwise whoever runs the module calls `ready` first."""
        self.pin(module)
        pairs = self._host[id(module)]
        if all(t.device.type == "cuda" for t, _ in pairs):
            return
        current = torch.cuda.current_stream(self.device)
        # Allocated on the current stream: memory that stream just freed (an evicted model) is
        # reused in its order, and the side stream starts only after the work queued so far.
        buffers = [torch.empty_like(host, device=self.device) for _, host in pairs]
        allocated = torch.cuda.Event()
        allocated.record(current)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(allocated)
            for buf, (_, host) in zip(buffers, pairs):
                buf.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        for buf, (t, _) in zip(buffers, pairs):
            t.data = buf
        self._events[id(module)] = done
        if wait:
            self.ready(module)

    def ready(self, module: torch.nn.Module) -> None:
        """Make the current stream wait for `module`'s copy (nothing when none is pending)."""
        event = self._events.pop(id(module), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def to_host(self, module: torch.nn.Module) -> None:
        """Point `module`'s tensors at their pinned host copies; a module not pinned yet is copied
        down into new pinned buffers first. A pending copy completes before its buffers are freed."""
        self.ready(module)
        self.pin(module)
        for t, host in self._host[id(module)]:
            t.data = host
