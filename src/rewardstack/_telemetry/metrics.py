"""Prometheus metrics of a scoring process: memory, model calls, OOMs, completions, steps, swaps,
trainer batches (`observe_trainer_batch`).

Names follow Prometheus's conventions: the `rewardstack_` prefix, base units in the name
(`_bytes`, `_seconds`, `_ratio`), `_total` on counters, labels for the model and the status.
`registry()` is the process's registry: `rewardstack score --metrics-port P` serves it on
loopback (`serve`), and the HTTP service mounts the same one (`render` gives the exposition text
and its content type). A `Metrics` is the set of instruments on one registry; tests give each
monitor a registry of its own.
"""

from __future__ import annotations

import ipaddress
import threading
from typing import Any, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_lock = threading.Lock()
_registry: CollectorRegistry | None = None
_metrics: dict[int, "Metrics"] = {}

# Powers of 4 from 64 KiB to 256 GiB: a tiny encoder's call to a 7B model's long batch.
BYTES_BUCKETS = tuple(float(4**k * 64 * 1024) for k in range(12)) + (float("inf"),)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
# Requests or inputs in one trainer batch: powers of 2 to 4096; tokens: powers of 4 from 64 to 16M.
COUNT_BUCKETS = tuple(float(2**k) for k in range(13)) + (float("inf"),)
TOKEN_BUCKETS = tuple(float(4**k * 64) for k in range(10)) + (float("inf"),)
# Relative error of the cost model, (measured - predicted) / predicted: negative is an overestimate.
ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, float("inf"))


def registry() -> CollectorRegistry:
    """The process-wide registry that `score --metrics-port` serves and the service mounts."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = CollectorRegistry(auto_describe=True)
        return _registry


def render(reg: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """(exposition text, content type) of a registry (the process's by default)."""
    return generate_latest(reg if reg is not None else registry()), CONTENT_TYPE_LATEST


class Metrics:
    """Every rewardstack instrument, registered once on one registry (see `metrics_for`)."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.registry = reg
        p = "rewardstack_"
        g = lambda name, doc, labels=(): Gauge(p + name, doc, labels, registry=reg)  # noqa: E731
        h = lambda name, doc, buckets: Histogram(p + name, doc, ["model"], buckets=buckets, registry=reg)  # noqa: E731
        self.allocated = g("device_memory_allocated_bytes", "Bytes held by live tensors on the device (simulated device on CPU).")
        self.reserved = g("device_memory_reserved_bytes", "Bytes the caching allocator holds from the driver.")
        self.fragmentation = g("device_memory_fragmentation_bytes", "Reserved bytes that hold no live tensor (reserved minus allocated).")
        self.inactive_split = g("device_memory_inactive_split_bytes", "Bytes in inactive split blocks (fragmentation the allocator cannot release).")
        self.device_free = g("device_memory_free_bytes", "Free bytes on the device (torch.cuda.mem_get_info).")
        self.budget = g("memory_budget_bytes", "The activation budget the batch planner fills.")
        self.host_rss = g("host_memory_rss_bytes", "Resident set size of the scoring process.")
        self.alloc_retries = Counter(p + "device_alloc_retries_total", "Device allocations retried after flushing the allocator's cache.", registry=reg)
        self.call_peak = h("model_call_peak_bytes", "Peak bytes of one model call above what was live before it.", BYTES_BUCKETS)
        self.call_seconds = h("model_call_duration_seconds", "Wall time of one model call (one planned batch).", SECONDS_BUCKETS)
        self.cost_error = h("cost_model_error_ratio", "Relative error of the cost model per call: (measured - predicted) / predicted.",
                            ERROR_BUCKETS)
        self.ooms_recovered = Counter(p + "ooms_recovered_total", "OOMs recovered by splitting the batch or scoring on the CPU.", ["model"], registry=reg)
        self.ooms_lost = Counter(p + "ooms_lost_total", "OOMs that left an input unscored (status 'oom').", ["model"], registry=reg)
        self.completions = Counter(p + "completions_total", "Completions scored, by model and status.", ["model", "status"], registry=reg)
        self.steps = Counter(p + "steps_total", "Validator steps scored.", registry=reg)
        self.step_seconds = Histogram(p + "step_duration_seconds", "Wall time of one validator step.", buckets=SECONDS_BUCKETS, registry=reg)
        self.swaps = Counter(p + "placement_swaps_total", "Models swapped onto the device by placement.", ["model"], registry=reg)
        self.alarms = Counter(p + "memory_alarms_total", "Leak and fragmentation alarms raised, by the series that trended.", ["series"], registry=reg)
        self.incidents = Counter(p + "incidents_total", "OOM incident records written.", registry=reg)
        b = lambda name, doc, buckets: Histogram(p + name, doc, buckets=buckets, registry=reg)  # noqa: E731
        self.trainer_batch_requests = b("trainer_batch_requests", "Trainer requests scored together in one batch.", COUNT_BUCKETS)
        self.trainer_batch_inputs = b("trainer_batch_inputs", "Inputs (texts or chats) of one trainer batch.", COUNT_BUCKETS)
        self.trainer_batch_tokens = b("trainer_batch_tokens", "Tokens one trainer batch read, over its models.", TOKEN_BUCKETS)
        self.trainer_queue_wait = b("trainer_queue_wait_seconds", "Time a trainer request waited before its batch started.",
                                    SECONDS_BUCKETS)

    def observe_snapshot(self, snap: Any, budget: int | None) -> None:
        """Set the memory gauges from a `MemorySnapshot` (figures it lacks are left alone)."""
        for gauge, value in ((self.allocated, snap.allocated), (self.reserved, snap.reserved),
                             (self.fragmentation, snap.fragmentation), (self.inactive_split, snap.inactive_split),
                             (self.device_free, snap.device_free), (self.host_rss, snap.host_rss),
                             (self.budget, budget)):
            if value is not None:
                gauge.set(value)


def metrics_for(reg: CollectorRegistry | None = None) -> Metrics:
    """The instruments on `reg` (the process's registry by default), created on first use."""
    reg = reg if reg is not None else registry()
    with _lock:
        m = _metrics.get(id(reg))
        if m is None or m.registry is not reg:
            m = _metrics[id(reg)] = Metrics(reg)
        return m


def observe_trainer_batch(requests: int, inputs: int, tokens: int, waits: Sequence[float],
                          reg: CollectorRegistry | None = None) -> None:
    """Record one trainer batch (the scheduler calls this once per batch it scored): how many
    requests, inputs and tokens it held, and how long each request waited before it started."""
    m = metrics_for(reg)
    m.trainer_batch_requests.observe(requests)
    m.trainer_batch_inputs.observe(inputs)
    m.trainer_batch_tokens.observe(tokens)
    for wait in waits:
        m.trainer_queue_wait.observe(wait)


def serve(port: int, *, host: str = "127.0.0.1", reg: CollectorRegistry | None = None) -> Any:
    """Serve a registry over HTTP on a loopback address (`port` 0 picks a free port).

    Returns prometheus_client's WSGI server, serving on a thread of its own: its `server_port` is the
    bound port; `shutdown()` and then `server_close()` stop it.
    """
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"metrics are served on loopback only, not {host}")
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=reg if reg is not None else registry())
    return server
