"""The Ray subcommands of the `rewardstack` command line (parsers and thin command functions).

`cli.build_parser` calls `add_parsers`; nothing here imports Ray until a command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from rewardstack._argtypes import non_negative_float, positive_int
from rewardstack._modelflags import add_model_flags
from rewardstack._models import is_user_model


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

    s = sub.add_parser("ray-serve", help="run the scoring service and the trainer routes on Ray Serve: replicas "
                                         "behind one URL, one state actor per namespace (docs/RAY.md)")
    s.add_argument("--config", help="stack config (TOML); its [service] table gives the limits; optional with "
                                    "--reward-model")
    add_model_flags(s)
    s.add_argument("--state-dir", help="folder of the namespaces' state (default: the config's state_dir); on a "
                                       "cluster of several nodes, storage every node mounts")
    s.add_argument("--ray-address", help="join this Ray cluster, e.g. auto (default: start a local Ray with this "
                                         "machine's cores)")
    s.add_argument("--replicas", type=positive_int, default=1, help="scoring replicas (each loads the stack once)")
    s.add_argument("--max-replicas", type=positive_int,
                   help="let Serve's autoscaler run between --replicas and this many replicas")
    s.add_argument("--gpus-per-replica", type=non_negative_float, default=None,
                   help="GPUs per replica (default 1 where CUDA is present, else 0)")
    s.add_argument("--cpus-per-replica", type=non_negative_float, default=1.0, help="CPUs per replica")
    s.add_argument("--max-ongoing-requests", type=positive_int,
                   help="requests a replica takes at once (default 512: two slices of one-sample requests); more wait at the proxy")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests each Serve proxy holds for the replicas before answering 503 with Retry-After "
                        "(default 16384; -1: no bound)")
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

    from rewardstack._distributed import cluster
    from rewardstack._service.command import checked_access, command_config, effective_settings

    config = command_config(args)
    settings = effective_settings(config, args)
    access = checked_access(settings)
    if access is None:
        return 2
    state_dir = args.state_dir or config.state_dir
    started = cluster.connect(args.ray_address)
    try:
        from ray import serve

        from rewardstack._distributed.serve import APP_NAME, MAX_QUEUED_REQUESTS, build_app, stop_namespace_actors

        if any(not is_user_model(m.name) for m in config.active_models()):  # validators' state is written
            cluster.check_shared_path(state_dir, "--state-dir")
        gpus = args.gpus_per_replica if args.gpus_per_replica is not None else cluster.default_gpus_per_worker()
        serve.start(http_options={"host": settings.host, "port": settings.port})
        queued = MAX_QUEUED_REQUESTS if args.max_queued_requests is None else args.max_queued_requests
        app = build_app(config, settings, access.hashes, state_dir=state_dir, replicas=args.replicas,
                        max_replicas=args.max_replicas, gpus_per_replica=gpus, cpus_per_replica=args.cpus_per_replica,
                        max_ongoing_requests=args.max_ongoing_requests, max_queued_requests=queued)
        models = [m.name for m in config.active_models()]
        say(f"starting {args.replicas} replica(s) ({gpus:g} GPU, {args.cpus_per_replica:g} CPU each), each loading "
            f"{len(models)} model(s): {', '.join(models)}")
        run_with_progress(lambda: serve.run(app, name=APP_NAME, route_prefix="/"), args.replicas)
        say(f"ready on http://{settings.host}:{settings.port} ({args.replicas} replica(s); trainers: /get_reward, "
            f"/classify; validators: /v1/score, namespaces in {state_dir}/namespaces)")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(APP_NAME)  # replicas finish their requests; every answered step is committed
        stop_namespace_actors(state_dir)
        serve.shutdown()
    finally:
        if started:
            cluster.require_ray().shutdown()
    return 0


def say(line: str) -> None:
    """One progress line of `ray-serve` on stderr."""
    print(f"rewardstack ray-serve: {line}", file=sys.stderr, flush=True)


def run_with_progress(deploy: Callable[[], Any], replicas: int) -> None:
    """Run `deploy` (Serve's deployment, which returns once every replica has loaded), saying every
    few seconds how many replicas are up: loading takes a minute or more per replica."""
    import threading

    from ray import serve

    from rewardstack._distributed.serve import APP_NAME

    done = threading.Event()

    def watch() -> None:
        last = None
        while not done.wait(5.0):
            try:
                app = serve.status().applications.get(APP_NAME)
                states = {str(k.value if hasattr(k, "value") else k): v
                          for d in (app.deployments.values() if app else []) for k, v in d.replica_states.items()}
            except Exception:  # noqa: BLE001 - progress only; the deployment reports its own failure
                continue
            line = f"replicas: {states.get('RUNNING', 0)} of {replicas} ready" + (
                f", {states.get('STARTING', 0)} loading" if states.get("STARTING") else "")
            if line != last:
                say(line)
                last = line

    threading.Thread(target=watch, name="rewardstack-serve-progress", daemon=True).start()
    try:
        deploy()
    finally:
        done.set()
