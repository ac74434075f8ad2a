"""Telemetry for a scoring command: the monitor with its run directory, metrics and endpoint.

`open_telemetry(stack, run_dir=..., metrics_port=...)` opens what the command line and the
`[telemetry]` table ask for (None when neither asks for anything); `Telemetry.close()` finishes
the run directory and stops the endpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rewardstack.errors import ConfigError
from rewardstack._settings import TelemetrySettings
from rewardstack._telemetry.alarms import Alarms
from rewardstack._telemetry.metrics import metrics_for, serve
from rewardstack._telemetry.monitor import Monitor
from rewardstack._telemetry.rundir import RunDir

log = logging.getLogger("rewardstack.telemetry")


def open_telemetry(stack: Any, *, run_dir: str | Path | None = None, metrics_port: int | None = None) -> "Telemetry | None":
    """Telemetry for a scoring command: the run directory and/or metrics endpoint asked for.

    `run_dir` and `metrics_port` (command-line flags) override the stack config's `[telemetry]`
    table (whose `run_dir` the config resolved against its own folder). Neither set: None, nothing
    is watched.
    """
    settings = stack.config.telemetry
    run_dir = run_dir if run_dir is not None else settings.run_dir or None
    metrics_port = metrics_port if metrics_port is not None else settings.metrics_port
    if run_dir is None and metrics_port is None:
        return None
    return Telemetry(stack, run_dir=run_dir, metrics_port=metrics_port, settings=settings)


class Telemetry:
    """A monitor with its run directory, metrics and endpoint, opened and closed together."""

    def __init__(self, stack: Any, *, run_dir: str | Path | None, metrics_port: int | None, settings: Any = None,
                 registry: Any = None) -> None:
        s = settings if settings is not None else TelemetrySettings()
        rd = RunDir(run_dir, max_bytes=s.max_bytes, keep_incidents=s.keep_incidents,
                    keep_snapshots=s.keep_snapshots) if run_dir is not None else None
        alarms = Alarms(window=s.leak_window, warmup=s.leak_warmup, leak_bytes_per_step=s.leak_bytes_per_step,
                        host_leak_bytes_per_step=s.host_leak_bytes_per_step,
                        fragmentation_bytes_per_step=s.fragmentation_bytes_per_step)
        self.server = None
        if metrics_port is not None:
            try:
                self.server = serve(metrics_port, reg=registry)
            except OSError as e:  # the port is taken, or not ours to bind
                if rd is not None:
                    rd.close()
                raise ConfigError("telemetry.metrics_port", f"cannot serve metrics on 127.0.0.1:{metrics_port}: {e}") from e
            log.info("metrics on http://%s:%d/metrics", *self.server.server_address[:2])
        self.monitor = Monitor.attach(stack, run_dir=rd, metrics=metrics_for(registry), alarms=alarms,
                                      history_entries=s.history_entries)

    def close(self) -> None:
        """Finish the run directory and stop the endpoint."""
        self.monitor.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
