"""Leak and fragmentation alarms: a least-squares slope over memory at rest, step after step.

After each step the monitor feeds each series (device bytes allocated at rest, host resident set
size, fragmentation bytes, inactive-split share of the reserved bytes) one value. Growth the stack
expects and bounds is declared and subtracted first: the diversity history grows by one row per
completion until it is full, which is not a leak. Once the window is full, the slope of a
least-squares line through its values (units per step) is compared with the series' threshold; above
it, the alarm trips once, names the trend (`Trend.describe`), and re-arms only after the slope has
fallen below half the threshold. The first `warmup` steps are left out: caches and lazily built
buffers fill then.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Trend:
    """A series that trended up: its slope over the window and what it went from and to."""

    series: str
    slope: float
    """Units per step (bytes per step; share per step for `inactive_split_share`)."""
    threshold: float
    window: int
    first_step: int
    last_step: int
    first: float
    last: float
    unit: str = "bytes"

    def describe(self) -> str:
        """One line that names the trend, for the log."""
        if self.unit == "bytes":
            rate = f"{self.slope / 1024**2:+.3f} MiB/step"
            span = f"{self.first / 1024**2:.1f} MiB -> {self.last / 1024**2:.1f} MiB"
            limit = f"{self.threshold / 1024**2:.3f} MiB/step"
        else:
            rate, span, limit = f"{self.slope:+.4f}/step", f"{self.first:.3f} -> {self.last:.3f}", f"{self.threshold:.4f}/step"
        return (f"memory alarm: {self.series} grows {rate} over the last {self.window} steps "
                f"(steps {self.first_step}-{self.last_step}: {span}; threshold {limit})")


class SlopeAlarm:
    """One series' sliding window and threshold."""

    def __init__(self, series: str, threshold: float, window: int, *, unit: str = "bytes", warmup: int = 0) -> None:
        # A window of at least 2 steps (`[telemetry] leak_window` is checked so) always has distinct steps.
        self.series = series
        self.threshold = float(threshold)
        self.window = window
        self.unit = unit
        self.warmup = warmup
        self.seen = 0
        self.points: deque[tuple[int, float]] = deque(maxlen=window)
        self.armed = True
        self.last_slope: float | None = None

    def observe(self, step: int, value: float) -> Trend | None:
        """Add one value at rest; the Trend when this step trips the alarm, else None."""
        self.seen += 1
        if self.seen <= self.warmup:
            return None
        self.points.append((step, float(value)))
        if len(self.points) < self.window:
            return None
        steps, ys = zip(*self.points)
        k = self.last_slope = statistics.linear_regression(steps, ys).slope
        if k > self.threshold and self.armed:
            self.armed = False
            return Trend(self.series, k, self.threshold, self.window, steps[0], steps[-1], ys[0], ys[-1], self.unit)
        if k < self.threshold / 2:
            self.armed = True
        return None


class Alarms:
    """The monitor's alarms over memory at rest.

    `leak_bytes_per_step` applies to the device's allocated bytes, `host_leak_bytes_per_step` to
    the process's RSS and `fragmentation_bytes_per_step` to reserved minus allocated (the inactive-split
    share's threshold is fixed: 0.002 per step). A threshold of 0 or less turns a series off.
    """

    def __init__(
        self,
        *,
        window: int = 100,
        warmup: int = 10,
        leak_bytes_per_step: float = 1024**2,
        host_leak_bytes_per_step: float = 4 * 1024**2,
        fragmentation_bytes_per_step: float = 4 * 1024**2,
    ) -> None:
        spec = [("device_allocated", leak_bytes_per_step, "bytes"), ("host_rss", host_leak_bytes_per_step, "bytes"),
                ("fragmentation", fragmentation_bytes_per_step, "bytes"),
                ("inactive_split_share", 0.002, "share")]
        self.alarms = {name: SlopeAlarm(name, t, window, unit=u, warmup=warmup) for name, t, u in spec if t > 0}
        self.trends: list[Trend] = []

    def observe(self, step: int, snap: Any, declared: dict[str, int] | None = None) -> list[Trend]:
        """Feed one step's snapshot at rest (minus declared growth); the trends it trips."""
        declared = declared or {}
        values = {
            "device_allocated": None if snap.allocated is None else snap.allocated - declared.get("device", 0),
            "host_rss": None if snap.host_rss is None else snap.host_rss - declared.get("host", 0),
            "fragmentation": snap.fragmentation if snap.source == "cuda" else None,
            "inactive_split_share": snap.inactive_split_share if snap.source == "cuda" else None,
        }
        tripped = []
        for name, alarm in self.alarms.items():
            t = alarm.observe(step, values[name]) if values[name] is not None else None
            if t is not None:
                tripped.append(t)
        self.trends.extend(tripped)
        return tripped

    def verdict(self) -> dict[str, Any]:
        """For the summary: whether any alarm tripped, the trends, and each series' last slope."""
        return {
            "leak": any(t.series in ("device_allocated", "host_rss") for t in self.trends),
            "fragmentation": any(t.series in ("fragmentation", "inactive_split_share") for t in self.trends),
            "trends": [asdict(t) for t in self.trends],
            "slopes": {n: a.last_slope for n, a in self.alarms.items()},
        }
