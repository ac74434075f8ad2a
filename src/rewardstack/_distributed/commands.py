"""The Ray subcommands of the `rewardstack` command line (parsers and thin command functions).

`cli.build_parser` calls `add_parsers`; nothing here imports Ray until a command runs.
"""

from __future__ import annotations

import argparse
import sys

from rewardstack._argtypes import non_negative_float, positive_int


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `rescore` (and the Ray Serve command) to the `rewardstack` subcommands."""
    r = sub.add_parser("rescore", help="re-score an archive of runs on a pool of Ray actors (one parquet per run)")
    r.add_argument("runs", nargs="*", help="runs: parquet or JSONL files, validator log folders, or folders of runs")
    r.add_argument("--runs-from", action="append", default=[], metavar="FILE",
                   help="a text file of run paths, one per line (for archives too large for the command line)")
    r.add_argument("--config", required=True, help="stack config (TOML)")
    r.add_argument("--output", required=True, help="folder for one parquet table per run and manifest.jsonl")
    r.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray with this machine's cores)")
    r.add_argument("--gpus-per-worker", type=non_negative_float, default=None,
                   help="GPUs per worker actor (default 1 where CUDA is present, else 0; 0.5 puts two on a card)")
    r.add_argument("--cpus-per-worker", type=non_negative_float, default=1.0, help="CPUs per worker actor (torch threads on CPU)")
    r.add_argument("--workers", type=positive_int, default=None,
                   help="worker actors (default: as many as the cluster's GPUs or CPUs hold, at most one per run)")
    r.add_argument("--max-attempts", type=positive_int, default=3,
                   help="times a run is started before it is marked failed (its worker dying each time)")
    r.set_defaults(func=cmd_rescore)

    s = sub.add_parser("ray-serve", help="run the scoring service on Ray Serve: stateless replicas, one state actor "
                                         "per namespace (docs/RAY.md)")
    s.add_argument("--config", required=True, help="stack config (TOML); its [service] table gives the limits")
    s.add_argument("--state-dir", required=True,
                   help="folder of the namespaces' state; on a cluster of several nodes, storage every node mounts")
    s.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray with this machine's cores)")
    s.add_argument("--replicas", type=positive_int, default=1, help="scoring replicas (each loads the stack once)")
    s.add_argument("--gpus-per-replica", type=non_negative_float, default=None,
                   help="GPUs per replica (default 1 where CUDA is present, else 0)")
    s.add_argument("--cpus-per-replica", type=non_negative_float, default=1.0, help="CPUs per replica")
    s.add_argument("--host", help="address Serve's HTTP proxy binds (default [service].host)")
    s.add_argument("--port", type=int, help="port of Serve's HTTP proxy (default [service].port)")
    s.add_argument("--tokens-file", help="TOML table of token SHA-256 -> namespace (as `rewardstack serve`)")
    s.set_defaults(func=cmd_ray_serve)


def cmd_rescore(args: argparse.Namespace) -> int:
    """Re-score runs; exit 0 when every run is complete, 2 when some failed."""
    from rewardstack.config import load_config
    from rewardstack._distributed import cluster
    from rewardstack._distributed.rescore import rescore
    from rewardstack._distributed.runs import discover_runs
    from rewardstack.errors import InputError

    if not args.runs and not args.runs_from:
        raise InputError("no runs given (pass files or folders, or --runs-from FILE)")
    config = load_config(args.config)
    runs = discover_runs(args.runs, list_files=args.runs_from)
    started = cluster.connect(args.ray_address)
    try:
        gpus = args.gpus_per_worker if args.gpus_per_worker is not None else cluster.default_gpus_per_worker()
        report = rescore(runs, config, args.output, workers=args.workers, gpus_per_worker=gpus,
                         cpus_per_worker=args.cpus_per_worker, max_attempts=args.max_attempts)
    finally:
        if started:
            cluster.require_ray().shutdown()
    for entry in report.failed:
        print(f"failed: {entry['input']}: {entry.get('error')}", file=sys.stderr)
    return 0 if report.ok else 2


def cmd_ray_serve(args: argparse.Namespace) -> int:
    """Deploy the Serve application and keep it up until SIGTERM or Ctrl-C; then stop it cleanly."""
    import signal
    import threading

    from rewardstack.config import load_config
    from rewardstack._distributed import cluster
    from rewardstack._service.command import checked_access, effective_settings

    config = load_config(args.config)
    settings = effective_settings(config, args)
    access = checked_access(settings)
    if access is None:
        return 2
    started = cluster.connect(args.ray_address)
    try:
        from ray import serve

        from rewardstack._distributed.serve import APP_NAME, build_app, stop_namespace_actors

        cluster.check_shared_path(args.state_dir, "--state-dir")
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else cluster.default_gpus_per_worker()
        serve.start(http_options={"host": settings.host, "port": settings.port})
        app = build_app(config, settings, access.hashes, state_dir=args.state_dir, replicas=args.replicas,
                        gpus_per_replica=gpus, cpus_per_replica=args.cpus_per_replica)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"rewardstack ray-serve: http://{settings.host}:{settings.port} ({args.replicas} replicas, "
              f"namespaces in {args.state_dir}/namespaces)", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(APP_NAME)  # replicas finish their requests; every answered step is committed
        stop_namespace_actors(args.state_dir)
        serve.shutdown()
    finally:
        if started:
            cluster.require_ray().shutdown()
    return 0
