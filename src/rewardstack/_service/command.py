"""`rewardstack serve`: its flags (over the [service] table, and the one-line start's `--reward-model`
flags: rewardstack._modelflags) and the uvicorn run with a clean drain, with its progress on stderr.

Kept apart from `app.py` so that building the CLI parser does not import FastAPI; the service's
dependencies come with the `rewardstack[service]` extra.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rewardstack.errors import ConfigError, MissingExtraError
from rewardstack._modelflags import add_model_flags, model_flags

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack.config import StackConfig
    from rewardstack._settings import ServiceSettings
    from rewardstack._service.access import Access

_INT_FLAGS = ("port", "max_completions", "max_chars", "max_work_chars", "queue_size", "batch_requests", "max_namespaces")


class _ServiceHelp(argparse.HelpFormatter):
    """Each [service] flag's help is its setting's docstring, read when `serve --help` prints it:
    building the parser (`rewardstack --help`) imports no pydantic."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        from rewardstack._settings import ServiceSettings

        field = ServiceSettings.model_fields.get(action.dest)
        return f"{field.description} {action.help}" if field is not None else action.help


def add_parser(sub: Any) -> None:
    """The `serve` subcommand (called from `rewardstack.cli.build_parser`)."""
    s = sub.add_parser("serve", help="run the HTTP scoring service (FastAPI on uvicorn; docs/SERVICE.md)",
                       formatter_class=_ServiceHelp)
    s.add_argument("--config", help="stack config (TOML); optional with --reward-model")
    add_model_flags(s)
    s.add_argument("--host", help="(default [service].host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="(default [service].port, 8000)")
    for key, kind in (("max_body_bytes", str), ("max_completions", int), ("max_chars", int), ("max_work_chars", int),
                      ("queue_size", int), ("deadline_s", float), ("batch_requests", int), ("max_namespaces", int),
                      ("tokens_file", str)):
        s.add_argument("--" + key.replace("_", "-"), type=kind, help=f"(default [service].{key})")
    s.add_argument("--run-dir", help="telemetry run directory: timeline, events, incidents, summary (default [telemetry].run_dir)")
    s.add_argument("--state-dir", help="folder of the namespaces' state (default: the config's state_dir, else "
                   "$REWARDSTACK_HOME/<config stem>-<hash>/state)")
    s.add_argument("--recalibrate", action="store_true", help="profile every model again instead of reading saved "
                   "cost models (and time the speed settings again: docs/MEMORY.md)")
    s.set_defaults(func=cmd_serve)


def command_config(args: argparse.Namespace) -> StackConfig:
    """The config of `serve`'s and `ray-serve`'s flags: --config's file, the --reward-model tables, or both."""
    from rewardstack.config import build_config

    if not args.config and not args.reward_model:
        raise ConfigError("--config", "give a stack config (--config C), a reward model (--reward-model PATH), or both")
    return build_config(args.config, **model_flags(args))


def effective_settings(config: StackConfig, args: argparse.Namespace) -> ServiceSettings:
    """The [service] table with the command line's flags over it."""
    from rewardstack._settings import parse_bytes

    s = config.service.model_copy()
    for key in _INT_FLAGS + ("host", "deadline_s", "tokens_file"):
        value = getattr(args, key, None)
        if value is not None:
            setattr(s, key, value)
    if getattr(args, "max_body_bytes", None) is not None:
        s.max_body_bytes = parse_bytes(args.max_body_bytes, key="--max-body-bytes")
    return s


def checked_access(settings: ServiceSettings) -> Access | None:
    """The service's `Access` (its bearer tokens), or None after printing why it may not bind:
    a host that is not loopback needs a token."""
    from rewardstack._service.access import Access, is_loopback

    access = Access.load(settings.tokens_file)
    if not is_loopback(settings.host) and not access.required:
        print(f"rewardstack: error: binding {settings.host} (not loopback) requires a bearer token: set "
              "REWARDSTACK_TOKEN or [service].tokens_file (never a command-line flag)", file=sys.stderr)
        return None
    return access


def announce_ready(worker: Any, url: str) -> None:
    """One stderr line once the worker is ready (models loaded, calibrated, a startup pass done)."""
    started = time.monotonic()
    while not (worker.ready or worker.error or worker.closed):
        time.sleep(0.1)
    if worker.ready:
        print(f"rewardstack serve: ready on {url} after {time.monotonic() - started:.1f}s "
              "(trainers: /get_reward, /classify; validators: /v1/score)", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the config, check access, serve until SIGTERM; 0 after a clean drain."""
    try:
        import uvicorn

        from rewardstack._service.app import create_app
        from rewardstack._service.edge import log_rate_limited, server_config
    except ImportError as e:  # depends on the install: one line and the exit code of a missing extra
        missing = MissingExtraError.of(e)
        if missing is None:  # not an extra's module: a broken install or a bug, its traceback kept
            raise
        raise missing from e
    from rewardstack._memory.manager import check_device

    config = command_config(args)
    check_device(config.device)  # one line now, not the worker's load failure after the server started
    if getattr(args, "state_dir", None):
        config.state_dir = args.state_dir
    settings = effective_settings(config, args)
    for key in _INT_FLAGS:
        if getattr(settings, key) < 1:
            print(f"rewardstack: error: --{key.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if settings.deadline_s <= 0:
        print("rewardstack: error: --deadline-s must be positive", file=sys.stderr)
        return 2
    access = checked_access(settings)
    if access is None:
        return 2
    if getattr(args, "run_dir", None):
        config.telemetry.run_dir = args.run_dir
    app = create_app(config, settings, access, recalibrate=bool(getattr(args, "recalibrate", False)))
    worker = app.state.worker

    stopped_by: list[str] = []  # the signal that asked for the shutdown, for its one line

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stopped_by.append(signal.Signals(sig).name)
            worker.begin_drain()  # queued steps get 503 now; the running batch finishes and commits
            super().handle_exit(sig, frame)

    level = "warning" if getattr(args, "verbose", 0) == 0 else "info"
    # Header and body timeouts, a cap on open connections, a drain bounded by drain_timeout_s.
    server = Server(server_config(app, settings, log_level=level))
    worker.on_fatal = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler installed
    # before it makes that re-raise harmless, so a drained shutdown returns and exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    url = f"http://{settings.host}:{settings.port}"
    models = [m.name for m in config.active_models()]
    print(f"rewardstack serve: loading {len(models)} model(s) on {config.device} ({', '.join(models)}), then "
          f"serving {url} (namespaces in {config.state_dir}/namespaces)", file=sys.stderr, flush=True)
    threading.Thread(target=announce_ready, args=(worker, url), name="rewardstack-announce", daemon=True).start()
    with log_rate_limited():  # after uvicorn set up its loggers: a flood of refusals or accept errors logs a few lines
        server.run()
    if worker.error:
        print(f"rewardstack: error: the stack failed to load: {worker.error}", file=sys.stderr)
        return 1
    why = f" on {stopped_by[0]}" if stopped_by else ""
    print(f"rewardstack serve: stopped{why}: drained, {worker.scored} steps scored, every namespace's state "
          f"committed in {config.state_dir}/namespaces", file=sys.stderr, flush=True)
    return 0
