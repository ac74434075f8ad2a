"""Cheaper swaps on CUDA: pinned host copies of swapped weights, copied on a separate stream.

CUDA-ONLY AND ISOLATED. `Placement(pinned=True)` on a CUDA device uses a `PinnedSwapper`; every
other placement (the CPU path, the tests' simulated placement) never creates one and moves
modules with `.to()` as before.

- **Pinned host copies.** `pin(module)` replaces each parameter's and buffer's host data by a
  page-locked copy once. A host-to-device copy from pinned memory runs at the link's speed and can
  be asynchronous; from pageable memory the driver stages it through a bounce buffer, synchronously.
- **No copy back.** Inference never writes weights, so swapping a model out only points its
  tensors back at their pinned host copies (`to_host`): the device memory is freed and nothing
  crosses the link.
- **A separate stream.** `to_device(module, wait=False)` issues the copies on the swapper's own
  stream and records an event; the current stream keeps computing (the model scoring now) while
  the next model's weights move. `ready(module)` makes the current stream wait for that event
  before the model runs (`Placement.ensure` calls it), and marks the new device tensors as used
  by the current stream so the caching allocator never hands their memory out early.
"""

from __future__ import annotations

import torch


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each distinct parameter and buffer of `module` (a tied tensor once)."""
    seen: set[int] = set()
    out = []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class PinnedSwapper:  # pragma: no cover - CUDA-only
    """Moves modules between pinned host copies and a CUDA device on a side stream."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("PinnedSwapper is CUDA-only")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._host: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._events: dict[int, torch.cuda.Event] = {}

    def pin(self, module: torch.nn.Module) -> None:
        """Give every host tensor of `module` a pinned copy (once; the module must be on the host)."""
        if id(module) in self._host:
            return
        pairs = []
        for t in _tensors(module):
            if t.device.type != "cpu":
                raise ValueError("pin a module while it is on the host")
            if not t.is_pinned():
                t.data = t.data.pin_memory()
            pairs.append((t, t.data))
        self._host[id(module)] = pairs

    def to_device(self, module: torch.nn.Module, *, wait: bool = True) -> None:
        """Copy `module`'s weights onto the device on the side stream; `wait`: the current stream waits."""
        self.pin(module)
        with torch.cuda.stream(self.stream):
            for t, host in self._host[id(module)]:
                t.data = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[id(module)] = event
        if wait:
            self.ready(module)

    def ready(self, module: torch.nn.Module) -> None:
        """Make the current stream wait for `module`'s copy (a no-op when none is pending)."""
        event = self._events.pop(id(module), None)
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t, _ in self._host.get(id(module), []):
            if t.device.type == "cuda":
                t.data.record_stream(current)

    def to_host(self, module: torch.nn.Module) -> None:
        """Point `module`'s tensors back at their pinned host copies (weights are never written)."""
        self.ready(module)
        if id(module) not in self._host:  # never swapped in through here: an ordinary move, then pin
            module.to("cpu")
            self.pin(module)
            return
        for t, host in self._host[id(module)]:
            t.data = host
