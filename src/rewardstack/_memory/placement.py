"""Model placement: which models stay resident on the device, which run on CPU, which are swapped in.

When the weights of the whole stack fit the weight budget, every model is resident. When they do
not, `plan()` decides per model, and logs each decision with its reason:

- `cpu`: small models that are allowed to (filters) run on the host, because swapping them in and
  out every step costs more transfer than their CPU forward pass; and models larger than the whole
  weight budget, which could never be on the device.
- `resident`: smallest first, as many as fit while leaving a swap slot
  big enough for the largest model that is swapped.
- `swap`: the rest, moved onto the device on demand by `ensure(name)`, evicting the least recently
  used swapped-in models until they fit. Every swap is counted and logged.

Modules shared by several models (one embedding model for relevance and diversity) are counted and
moved once, and never evicted while another model on the device still uses them. `summary()` says
so per model: its whole size (`bytes`), the bytes counted for it once across the stack
(`counted_bytes`, summing to the stack's weights) and the models it shares modules with.

On a CUDA card, swapped models move through `pinned.PinnedSwapper`: their weights keep a pinned
host copy, a swap-in is a copy on a side stream that `ensure` makes the pass wait for, and
`prefetch` starts the next model's copy while the model on the card runs. Resident models and
models on the host move with `.to()`. `host_bytes()` says what the host holds: the pinned copies
and the models that run there.

On a machine whose device is the host (CPU), placement is simulated: residency and swaps are
accounted exactly the same way but modules are not moved (`move=False`), so the logic is testable
without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch

from rewardstack._memory.budget import weights_bytes
from rewardstack._memory.pinned import PinnedSwapper, pinned_footprint, tensor_bytes

log = logging.getLogger("rewardstack.memory")

Where = Literal["resident", "cpu", "swap"]


@dataclass
class PlacementMove:
    """One model's weights moved by placement."""

    model: str
    direction: str
    """`in` (swapped onto the device) or `out` (evicted for another)."""
    bytes: int
    seconds: float | None
    """Wall time of the swap that moved it in (with pinned swaps on a card, the time to queue its
    copy: the pass waits for the copy on the device). None for an eviction, timed with its
    swap-in, and for a prefetch, whose copy runs beside another model's pass."""
    time: float
    """When the swap began (seconds since the epoch)."""


@dataclass
class Decision:
    """Where one model lives and why."""

    where: Where
    reason: str
    bytes: int = 0


@dataclass
class _Model:
    name: str
    modules: list[torch.nn.Module]
    cpu_ok: bool
    size: int


class Placement:
    """Decides and enforces where each registered model's weights live.

    `budget_bytes` is the device memory the weights may take (None: unlimited, all resident).
    Models allowed on CPU (`cpu_ok`) of at most 1/16 of the budget go to CPU when the stack does
    not fit. `pinned` (default: when it moves weights onto a CUDA device): swapped models move
    through a `PinnedSwapper`; False: with `.to()` from pageable host memory.
    """

    def __init__(
        self,
        device: torch.device | str,
        budget_bytes: int | None,
        *,
        move: bool | None = None,
        pinned: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        self.budget_bytes = budget_bytes
        # Moving only makes sense between two different memories; on a CPU-only box we simulate.
        self.move = (self.device != self.host) if move is None else move
        on_card = self.move and self.device.type == "cuda"
        self.swapper = PinnedSwapper(self.device) if on_card and pinned is not False else None
        self._swapped: set[int] = set()  # ids of modules that swap (the swapper moves them)
        self._models: dict[str, _Model] = {}
        self._sizes: dict[int, int] = {}  # id(module) -> bytes
        self._mods: dict[int, torch.nn.Module] = {}
        self.decisions: dict[str, Decision] = {}
        self._on_device: set[int] = set()  # ids of modules on the (real or simulated) device
        self._lru: OrderedDict[str, None] = OrderedDict()  # swapped-in models, least recent first
        self.swaps = 0
        self.evictions = 0
        self.prefetches = 0  # swaps (counted in `swaps`) that `prefetch` started beside another pass
        self.on_move: Callable[[PlacementMove], None] | None = None
        """Told of every move `ensure` makes (the memory manager forwards them to its observers)."""

    # -- registration -----------------------------------------------------------------------
    def register(self, name: str, modules: list[torch.nn.Module], *, cpu_ok: bool = False) -> None:
        """Add a model (its torch modules)."""
        for m in modules:
            self._mods[id(m)] = m
            self._sizes.setdefault(id(m), weights_bytes([m]))
            # Start from where the weights really are (models load onto the device), so that
            # `_apply` moves an offloaded model off the device instead of assuming it is not there.
            if any(_same_device(p.device, self.device) for p in m.parameters()):
                self._on_device.add(id(m))
        self._models[name] = _Model(name, list(modules), cpu_ok, self._bytes_of({id(m) for m in modules}))
        self.decisions.pop(name, None)

    def names(self) -> list[str]:
        """Registered model names."""
        return list(self._models)

    def total_bytes(self) -> int:
        """Weights of every registered model, shared modules counted once."""
        return sum(self._sizes.values())

    def _bytes_of(self, ids: set[int]) -> int:
        return sum(self._sizes[i] for i in ids)

    def _ids(self, name: str) -> set[int]:
        return {id(m) for m in self._models[name].modules}

    # -- planning ---------------------------------------------------------------------------
    def plan(self) -> dict[str, Decision]:
        """Decide where every registered model lives; log each decision and its reason."""
        budget = self.budget_bytes
        total = self.total_bytes()
        models = list(self._models.values())
        dec: dict[str, Decision] = {}
        if budget is None or total <= budget:
            why = "no weight budget" if budget is None else f"whole stack {_mib(total)} fits {_mib(budget)}"
            dec = {m.name: Decision("resident", why, m.size) for m in models}
        else:
            small = budget // 16
            rest: list[_Model] = []
            for m in models:
                if m.cpu_ok and m.size <= small:
                    dec[m.name] = Decision(
                        "cpu", f"small ({_mib(m.size)} <= {_mib(small)}): a CPU pass is cheaper than swapping it every step", m.size)
                elif m.size > budget:
                    dec[m.name] = Decision("cpu", f"{_mib(m.size)} exceeds the whole weight budget {_mib(budget)}", m.size)
                else:
                    rest.append(m)
            resident: set[int] = set()
            chosen: list[_Model] = []
            for m in sorted(rest, key=lambda m: (m.size, m.name)):
                trial = resident | self._ids(m.name)
                others = [o for o in rest if o is not m and o not in chosen]
                # Keep room for the largest model that will have to be swapped in.
                slot = max((self._bytes_of(self._ids(o.name) - trial) for o in others), default=0)
                if self._bytes_of(trial) + slot <= budget:
                    resident = trial
                    chosen.append(m)
            for m in rest:
                if m in chosen:
                    dec[m.name] = Decision("resident", f"fits with a swap slot left ({_mib(self._bytes_of(resident))} resident of {_mib(budget)})", m.size)
                else:
                    dec[m.name] = Decision("swap", f"{_mib(total)} of weights exceed {_mib(budget)}: swapped in on demand (LRU)", m.size)
        self.decisions = dec
        for name, d in dec.items():
            log.info("placement: %s -> %s (%s): %s", name, d.where, _mib(d.bytes), d.reason)
        self._apply()
        return dict(dec)

    def _resident_ids(self) -> set[int]:
        return set().union(*(self._ids(n) for n, d in self.decisions.items() if d.where == "resident"))

    def _swap_ids(self) -> set[int]:
        """Modules of swapped models that no resident model holds: those that move at every swap."""
        swapped = [self._ids(n) for n, d in self.decisions.items() if d.where == "swap"]
        return set().union(*swapped) - self._resident_ids()

    def host_bytes(self) -> tuple[int, int]:
        """(pinned, pageable) host bytes of the plan: the swapped models' pinned copies, which stay
        while they are on the device too, in the slabs `PinnedSwapper` packs them in (as the pinned
        allocator rounds those); and the weights of the models placed on the host. (With pageable
        `.to()` swaps the swapped weights are on the host only while off the device.)"""
        pinned = self._swap_ids()
        on_host = set().union(*(self._ids(n) for n, d in self.decisions.items() if d.where == "cpu"))
        footprint = sum(pinned_footprint(tensor_bytes(self._mods[i])) for i in pinned)
        return footprint, self._bytes_of(on_host - pinned - self._resident_ids())

    def _apply(self) -> None:
        """Put resident models on the device and the others on the host."""
        keep = self._resident_ids()
        self._wait_for(set(self._mods))  # a copy still under way completes before any move
        self._swapped = self._swap_ids()
        for i in list(self._mods):
            self._set(i, i in keep)
        if self.move and self.swapper is not None:  # pragma: no cover - CUDA-only
            for i in self._swapped:  # pinned now, not at the first swap: the plan's host bytes, held from the start
                self.swapper.pin(self._mods[i])
        self._lru.clear()

    def _set(self, mid: int, on_device: bool) -> None:
        if (mid in self._on_device) == on_device:
            return
        if self.move and self.swapper is not None and mid in self._swapped:  # pragma: no cover - CUDA-only
            if on_device:
                self.swapper.to_device(self._mods[mid], wait=False)  # `ensure` makes the pass wait
            else:
                self.swapper.to_host(self._mods[mid])
        elif self.move:
            self._mods[mid].to(self.device if on_device else self.host)  # CUDA-only in practice
        if on_device:
            self._on_device.add(mid)
        else:
            self._on_device.discard(mid)

    # -- running ----------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Weight bytes on the device now."""
        return self._bytes_of(self._on_device)

    def where(self, name: str) -> torch.device:
        """The device a model's forward runs on now (after `ensure`)."""
        return self.device if self._ids(name) <= self._on_device else self.host

    def ensure(self, name: str) -> Decision:
        """Make registered model `name` runnable: swap it onto the device (evicting LRU swapped-in models)
        if needed (`MemoryManager` asks only for the models it registered). With pinned swaps, the
        current stream then waits for its copy, however it was started."""
        d = self.decisions.get(name) or self.plan()[name]
        if d.where != "swap":
            return d
        need = self._ids(name)
        if need <= self._on_device:
            self._lru[name] = None
            self._lru.move_to_end(name)  # most recently used
        else:
            self._swap_in(name, self._victims(need, spare=set())[0], None)
        self._wait_for(need)
        return d

    def prefetch(self, name: str, *, busy: str | None = None) -> bool:
        """Start swapping `name` in without waiting for it, evicting only models other than `busy`
        (the model whose pass runs meanwhile, which must be on the device); `ensure(name)` later
        makes its pass wait for the copy. False, with nothing moved, when `name` is not swapped,
        is already on the device, or does not fit beside `busy`."""
        d = self.decisions.get(name)
        need = self._ids(name) if name in self._models else set()
        if d is None or d.where != "swap" or need <= self._on_device:
            return False
        if busy is not None and not self._ids(busy) <= self._on_device:
            return False
        victims, fits = self._victims(need, spare={busy} if busy else set())
        if not fits:
            return False
        self._swap_in(name, victims, "prefetch")
        self.prefetches += 1
        return True

    def _victims(self, need: set[int], spare: set[str]) -> tuple[list[str], bool]:
        """The swapped-in models to evict, least recently used first, so that `need` fits the budget
        (never one in `spare`), and whether it then fits."""
        budget = self.budget_bytes if self.budget_bytes is not None else float("inf")
        on = set(self._on_device)
        victims: list[str] = []
        order = [n for n in self._lru if n not in spare]
        while self._bytes_of(on | need) > budget and order:
            victim = order.pop(0)
            victims.append(victim)
            on -= self._ids(victim) - self._still_needed(victims, need)
        return victims, self._bytes_of(on | need) <= budget

    def _still_needed(self, leaving: list[str], need: set[int]) -> set[int]:
        """Modules that stay on the device when `leaving` go: a module shared with a model still on
        it, a resident one, or one `need` takes."""
        staying = [n for n in self._lru if n not in leaving]
        return set().union(*(self._ids(n) for n in staying), self._resident_ids(), need)

    def _swap_in(self, name: str, victims: list[str], how: str | None) -> None:
        """Evict `victims`, move `name` in, count and log the swap and tell `on_move`."""
        t0, p0 = time.time(), time.perf_counter()
        need = self._ids(name)
        for k, victim in enumerate(victims):
            for mid in self._ids(victim) - self._still_needed(victims[: k + 1], need):
                self._set(mid, False)
            del self._lru[victim]
            self.evictions += 1
        for mid in need:
            self._set(mid, True)
        self._lru[name] = None
        self.swaps += 1
        log.info("placement: %s %s (%s)%s; %d swaps so far", "prefetching" if how else "swapped in", name,
                 _mib(self._models[name].size), f", evicted {victims}" if victims else "", self.swaps)
        if self.on_move is not None:
            seconds = None if how else time.perf_counter() - p0
            self.on_move(PlacementMove(name, "in", self.decisions[name].bytes, seconds, t0))
            for v in victims:
                self.on_move(PlacementMove(v, "out", self.decisions[v].bytes, None, t0))

    def _wait_for(self, need: set[int]) -> None:
        """The current stream waits for the pinned copies of `need` (nothing without a swapper)."""
        if self.move and self.swapper is not None:  # pragma: no cover - CUDA-only
            for mid in need:
                self.swapper.ready(self._mods[mid])

    @contextmanager
    def lent_to_host(self, name: str) -> Iterator[int]:
        """Move `name`'s modules off the device for the body (a CPU fallback), then back.

        Yields the bytes moved (0 for a model already on the host). On a CPU-only machine
        (`move=False`) nothing moves and the host run is simulated, as for every placement.
        """
        moved = {i for i in self._ids(name) if i in self._on_device}
        for i in moved:
            self._set(i, False)
        try:
            yield self._bytes_of(moved)
        finally:
            for i in moved:
                self._set(i, True)
            self._wait_for(moved)  # the passes after the fallback run on the copy

    def counted(self) -> dict[str, tuple[int, list[str]]]:
        """Per model: the bytes counted for it with every module counted once, and the models it
        shares modules with. A shared module is counted for the first model (in registration
        order) that uses it and is wholly where the module is now (on the device, or not), so the
        models on the device sum to `device_bytes()` and all of them to `total_bytes()`."""
        users: dict[int, list[str]] = {}
        for name in self._models:
            for i in self._ids(name):
                users.setdefault(i, []).append(name)
        bytes_for = dict.fromkeys(self._models, 0)
        for i, names in users.items():
            here = i in self._on_device
            holder = next((n for n in names if (self._ids(n) <= self._on_device) == here), names[0])
            bytes_for[holder] += self._sizes[i]
        return {n: (bytes_for[n], sorted({o for i in self._ids(n) for o in users[i]} - {n})) for n in self._models}

    def summary(self) -> dict:
        """Decisions, swap counts and bytes, JSON-able (for logs and telemetry)."""
        counted = self.counted()
        return {
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes(),
            "device_bytes": self.device_bytes(),
            "swaps": self.swaps,
            "evictions": self.evictions,
            "models": {n: {"where": d.where, "reason": d.reason, "bytes": d.bytes, "counted_bytes": counted[n][0],
                           "shared_with": counted[n][1]} for n, d in self.decisions.items()},
            "swapped_in": list(self._lru),
        }


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are the same device when the index is left out."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"
