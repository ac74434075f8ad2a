"""Calibration: the load-time profiles that fit each model's cost model, and the cache that keeps the fits.

`Profile` is what a scorer hands the memory layer, its whole side of calibration (what to run at a
shape, which shapes it admits, what it tunes first); the manager (`MemoryManager.calibrate`) keeps
what calibration remembers (each model's key, the queue kept while the models load on the host, the
names profiled and the seconds spent, the run each fit was measured with) and fits a profile;
`measure_peak` is the peak of one call; every profile that runs is published as a `ProfileRecord`.

Profiling every model at every start costs a forward pass per profiled shape per model (minutes for
the full stack on a card). The fits depend only on what was measured and where, so each one is
saved in the `CalibrationCache` under a key made of:

- the model: its checkpoint by content (`checkpoint_identity`: a local folder by the sha256 of its
  weight and config files, a hub id by its id and revision) and the scorer's settings (name, dtype,
  max_length, batch size, options); not the config file or the folder the checkpoint sits in,
- the profile: the calibration's own arguments (longest length, batch, token cap, shapes, chunk),
- the machine: the device's name (the GPU model, or `cpu`), and the torch and transformers versions.

So every config that loads the same checkpoint the same way shares the fit: stand-ins built again
in another folder are not profiled again. Any change to one of these, or `--recalibrate`, profiles
again (and overwrites the entry). One JSON file for every config, written atomically (entries
another process wrote in the meantime are kept), at `$REWARDSTACK_HOME/calibration/cache.json`
(`rewardstack._paths`; a config's `[memory] calibration_file` overrides), separate from the scoring
state: deleting it only costs the next start its profile runs. It also keeps each checkpoint
file's digest by the file's path, size, modification time and inode, so a file is hashed once, not
at every start. A damaged file is logged and ignored (the start profiles), never an error.

Settings chosen by timing (`Profile.tune`: the encoders' pass size, DPO's logits chunk) are only as
good as the machine was quiet while they were timed. On CPU the manager times them under a
`CpuShare`, the share of the wall time the measuring thread was on a core (about 1 alone, about
0.5 with another process busy on every core), and keeps it in the entry. A tuning timed busy
(under `QUIET_SHARE`) keeps the profile's `planned` settings instead of what it measured, and a
later start that finds the machine quiet (`machine_quiet`, a short probe) times it again: a
loaded start can only err toward the plan, and not for longer than the load lasts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from rewardstack import _paths as paths
from rewardstack._fileio import atomic_write_text, sha256_of
from rewardstack._memory.costmodel import profile_shapes
from rewardstack._memory.device import PeakWindow, TensorBytesTracker
from rewardstack._models import owner_of

log = logging.getLogger("rewardstack.memory")

FORMAT = 7  # a cache of another format is read as empty (the start profiles again); CHANGELOG.md says when it changed
CHECKPOINT_FILES = (".safetensors", ".bin", ".pt", ".json")  # what a fit depends on in a checkpoint folder
QUIET_SHARE = 0.8
"""Least share of the wall time the measuring thread must run on a core for a timing to count as
quiet. Alone on a core it runs ~1.0 of the time; beside one busy process per core, ~0.5."""
QUIET_PROBE_SECONDS = 0.2
"""How long `machine_quiet` measures before re-timing a setting that was timed on a busy machine."""
wall_clock: Callable[[], float] = time.perf_counter
cpu_clock: Callable[[], float] = time.thread_time
"""The clocks `CpuShare` reads (module attributes: a test hands in timings by replacing them)."""


def environment(device: torch.device | str) -> dict[str, str]:
    """The machine part of a calibration key: the device (the GPU's model name, or the device type)
    and the torch and transformers versions."""
    import transformers

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__}


def cache_path_for(config_source: Path | str | None, explicit: str | Path | None = None) -> Path | None:
    """The calibration cache of a config: `explicit` (its `[memory] calibration_file`) if set, else
    the home's one cache (`paths.calibration_file()`), shared by every config file; None for a
    config built in code (its fits stay in memory)."""
    if explicit is not None:
        return Path(explicit)
    if config_source is None:
        return None
    return paths.calibration_file()


def checkpoint_identity(path: str, cache: "CalibrationCache") -> dict[str, Any]:
    """What a fit depends on of one checkpoint: a local folder by the sha256 over its weight and
    config files' names and contents (a copy elsewhere is the same checkpoint; a file rewritten is
    another), a hub id as given (its revision is in the scorer's settings). `cache` remembers
    each file's digest so that unchanged files are not read again."""
    folder = Path(path)
    if not folder.is_dir():
        return {"hub": path}
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in CHECKPOINT_FILES and f.is_file():
            h.update(f"{f.name}\0{cache.file_digest(f)}\0".encode())
    return {"sha256": h.hexdigest()}


class CalibrationCache:
    """Entries of fitted cost models by key, in one JSON file (None: kept in memory only)."""

    def __init__(self, path: Path | str | None, *, recalibrate: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.recalibrate = recalibrate
        self.hits = 0
        self._entries, self._digests = self._read(warn=True)
        self._unsaved = False  # digests computed since the file was written

    def _read(self, *, warn: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]]]:
        if self.path is None or not self.path.exists():
            return {}, {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"unknown format {data.get('format')!r}")
            digests = data.get("digests")
            return dict(data["entries"]), dict(digests) if isinstance(digests, dict) else {}
        except (OSError, ValueError, AttributeError) as e:
            if warn:
                log.warning("calibration cache %s unreadable (%s): profiling again", self.path, e)
            return {}, {}

    def file_digest(self, path: Path) -> str:
        """The sha256 of a file's content (`sha256_of`), remembered by the file's absolute path,
        size, mtime and inode."""
        st = path.stat()
        ident = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(path.resolve())
        seen = self._digests.get(key)
        if isinstance(seen, list) and len(seen) == 4 and seen[:3] == ident:
            return str(seen[3])
        digest = sha256_of(path)
        self._digests[key] = [*ident, digest]
        self._unsaved = True
        return digest

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored entry for `key` (None if absent, or always with `recalibrate`)."""
        entry = None if self.recalibrate else self._entries.get(key)
        if entry is not None:
            self.hits += 1
        return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store an entry and write the file atomically (temp file + rename)."""
        self._entries[key] = dict(entry, saved=time.time())
        self._unsaved = True
        self.save()

    def save(self) -> None:
        """Write entries and digests if anything is new (nothing for an in-memory cache)."""
        if self.path is None or not self._unsaved:
            return
        # One file for every config: keep what other processes saved since this one read it.
        entries, digests = self._read()
        self._entries = {**entries, **self._entries}
        self._digests = {**digests, **self._digests}
        data = {"format": FORMAT, "entries": self._entries, "digests": self._digests}
        try:
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True))
            self._unsaved = False
        except OSError as e:  # a read-only home costs the next start a profile, nothing else
            log.warning("calibration cache %s not written: %s", self.path, e)


@dataclass
class ProfileRecord:
    """One profile (a grid of dummy passes fitting a cost model) that ran, cache hits excepted."""

    name: str
    """The calibration's name, e.g. `dpo_reward_model[chunk=64]`."""
    model: str
    """The model it profiles (the name before any `[setting]`)."""
    time: float
    """When it began (seconds since the epoch)."""
    seconds: float
    shapes: int
    """(batch, length) shapes it measured."""


Shapes = Sequence[tuple[int, int]] | Callable[[dict[str, Any]], Sequence[tuple[int, int]]] | None


@dataclass
class Profile:
    """A scorer's profile, the one thing it hands `MemoryManager.calibrate`: what to run at a shape
    and which shapes it admits, plus what it measures before profiling.

    `run(B, L)`: one forward pass on a B x L dummy batch, on the scorer's own path (its prefix
    cache, its penalty): the fit is only as good as the passes it measured. `max_length`: the
    longest input the scorer admits (the planner admits nothing past the largest profiled shape).
    `max_tokens` drops shapes wider than that (B*L) from the default grid (and caps batches there).
    `chunk`: the scorer computes logits in chunks of this many positions (adds that term);
    `chunk_rows`: the chunks run over the rows of the whole batch, not of each sequence.
    `tune()`: settings measured before profiling (e.g. DPO's logits chunk, {"chunk": 128});
    `apply(settings)` hands them, or the cached ones, back to the scorer.
    `shapes` may be a function of those settings (a tuned pass size decides how wide the profiled
    batches must reach); its qualified name then stands for it in the cache key.
    `prefix_run(B, L, P)`: the pass after a shared prefix of P tokens (a causal scorer's
    `PrefixRunner`); profiled too, it lets `run(prefix=)` predict such passes below the bound.
    `lone_run(L)`: one unpadded input (an encoder drops the mask then); fits batches of one.
    `then()`: runs once the fit is in place, still at load and after the budget is set (DPO
    profiles there the smaller settings its budget needs, `dpo_chunks.ChunkPolicy`).
    `planned`: the settings `tune` starts from (the memory plan's, e.g. the encoders' pass size),
    kept instead of what `tune` measured when the machine was busy while it timed (`CpuShare`);
    None keeps what was measured (the entry is still timed again at a quiet start).
    """

    name: str
    run: Callable[[int, int], Any]
    max_length: int
    max_batch: int = 8
    shapes: Shapes = None
    chunk: int | None = None
    chunk_rows: bool = False
    max_tokens: int | None = None
    tune: Callable[[], dict[str, Any]] | None = None
    apply: Callable[[dict[str, Any]], None] | None = None
    prefix_run: Callable[[int, int, int], Any] | None = None
    lone_run: Callable[[int], Any] | None = None
    then: Callable[[], None] | None = None
    planned: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.shapes is None and self.max_tokens is None:
            self.max_tokens = int(self.max_length)  # batches up to one longest input's tokens (TEI-like)

    def key_args(self, tracked: bool) -> dict[str, Any]:
        """What the calibration key records of the profile (with the model's key and the
        environment). `tracked`: `tune` is timed under the simulated device's tracker."""
        grid_of = self.shapes if callable(self.shapes) else None
        grid = list(self.shapes) if self.shapes is not None and grid_of is None else None  # type: ignore[arg-type]
        return {"max_length": int(self.max_length), "max_batch": int(self.max_batch),
                "shapes": grid_of.__qualname__ if grid_of is not None else grid, "chunk": self.chunk,
                "chunk_rows": self.chunk_rows, "max_tokens": self.max_tokens, "tuned": self.tune is not None,
                "tuned_tracked": tracked and self.tune is not None, "prefixed": self.prefix_run is not None,
                "lone": self.lone_run is not None, "planned": self.planned}

    def grid(self, settings: dict[str, Any]) -> list[tuple[int, int]]:
        """The shapes to profile once `settings` (what `tune` measured) are known."""
        if callable(self.shapes):
            return list(self.shapes(settings))
        if self.shapes is not None:
            return list(self.shapes)
        return profile_shapes(self.max_length, self.max_batch, settings.get("chunk", self.chunk), self.max_tokens)


def calibration_key(request: Profile, model_keys: dict[str, dict[str, Any]], tracked: bool,
                    device: torch.device) -> str | None:
    """The profile's calibration key, a stable digest of (model, profile arguments, environment)
    (None: its model was never described, so nothing is cached). `tracked`: profiled under the
    simulated device's tracker."""
    model = model_keys.get(request.name, model_keys.get(owner_of(request.name)))
    if model is None:
        return None
    blob = json.dumps({"model": {"scorer": request.name, **model}, "profile": request.key_args(tracked),
                       "env": environment(device), "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


def measure_peak(fn: Callable[[], Any], name: str, tracker: TensorBytesTracker | None, device: torch.device) -> int:
    """Peak activation bytes of running `fn` in inference mode: the tracker's count on the simulated
    device (its budget lifted: profile runs may pass it), the allocator's on CUDA."""
    with torch.inference_mode():  # what `MemoryManager.run` does: no autograd graph is kept
        if tracker is not None:
            with tracker.window(name) as w, no_budget(tracker):
                fn()
            return w.peak_increase
        # CUDA: a nestable window of the allocator's peak (an open telemetry or replay window keeps its own).
        torch.cuda.synchronize(device)  # pragma: no cover - CUDA-only path
        with PeakWindow(device, None) as cw:  # pragma: no cover
            fn()
            torch.cuda.synchronize(device)
        return int(cw.peak_increase or 0)  # pragma: no cover


@contextmanager
def no_budget(tracker: TensorBytesTracker | None, *, enter: bool = False) -> Iterator[None]:
    """Lift the tracker's budget inside (profile and timing passes may pass it); keep counting.
    `enter`: count the current thread's ops too (nothing on CUDA, where there is no tracker)."""
    if tracker is None:
        yield
        return
    saved, tracker.budget_bytes = tracker.budget_bytes, None
    try:
        with tracker if enter else nullcontext():
            yield
    finally:
        tracker.budget_bytes = saved


class CpuShare:
    """The share of the wall time the calling thread ran on a core while the body ran (1.0 for an
    empty body): a busy machine's signal that no timing statistic can give, since a load that lasts
    the whole measurement slows every candidate alike. Thread CPU time, not the process's: torch's
    pool threads may sleep between ops on a quiet machine, the thread that drives them does not."""

    def __enter__(self) -> "CpuShare":
        self.share = 1.0
        self._wall, self._cpu = wall_clock(), cpu_clock()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = wall_clock() - self._wall
        if wall > 0:
            self.share = max(0.0, min(1.0, (cpu_clock() - self._cpu) / wall))

    @property
    def quiet(self) -> bool:
        return self.share >= QUIET_SHARE

    def record(self) -> dict[str, Any]:
        """What a cache entry keeps of the timing: the share, the verdict, the 1-minute load average
        per core when it ended (for the operator: it lags by a minute, so it decides nothing)."""
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        cores = os.cpu_count() or 1
        return {"cpu_share": round(self.share, 3), "quiet": self.quiet,
                "load_per_core": round(load / cores, 2) if load is not None else None}


def machine_quiet(seconds: float = QUIET_PROBE_SECONDS) -> bool:
    """Whether the calling thread, driving torch's threads through matrix products for `seconds`,
    stays on a core (`CpuShare.quiet`): the same signal the tuning was judged by."""
    a = torch.ones(192, 192)
    with torch.inference_mode(), CpuShare() as meter:
        end = wall_clock() + seconds
        while wall_clock() < end:
            a = (a @ a).clamp_(max=1.0)
    return meter.quiet
