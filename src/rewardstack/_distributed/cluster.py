"""Joining or starting Ray, and checks that a path is shared by every node of the cluster.

`rescore` writes its tables from every worker and the Serve deployment commits each namespace's
state from whichever node its state actor lives on, so both need a folder every node sees. A path
that exists on each node but is node-local (a local `/tmp`) would split the data silently; the check
writes a probe file from the driver and reads it back from a task pinned to each alive node.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from rewardstack.errors import ClusterError, MissingExtraError

log = logging.getLogger("rewardstack.distributed")

RAY_NAMESPACE = "rewardstack"
"""The Ray namespace of rewardstack's named actors (namespace state actors, rescore progress)."""


def require_ray() -> Any:
    """The `ray` module, or a clear error naming the extra to install."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - the ray extra is part of the test dependencies
        raise MissingExtraError("ray", "ray") from e
    return ray


def connect(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address`, or start a local Ray with this machine's cores.

    Returns True when this call started Ray (the caller then shuts it down). An already
    initialized Ray (a notebook, a test's cluster) is used as it is.
    """
    ray = require_ray()
    if ray.is_initialized():
        return False
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    else:
        cpus = num_cpus or os.cpu_count() or 1
        log.info("starting a local Ray with %d CPUs", cpus)
        ray.init(num_cpus=cpus, namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
    return True


def default_gpus_per_worker() -> float:
    """1 where this machine or the cluster has a CUDA device, else 0 (a CPU machine never waits)."""
    ray = require_ray()
    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0


def _reads(path: str, token: str) -> bool:
    try:
        return Path(path).read_text(encoding="utf-8") == token
    except OSError:
        return False


def check_shared_path(path: str | Path, what: str) -> None:
    """Refuse `path` when the cluster has more than one node and some node cannot see it.

    Raises ClusterError naming the nodes that do not see a file the driver wrote there.
    """
    ray = require_ray()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folder = Path(path).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    probe = folder / f".rewardstack-probe-{token}"
    probe.write_text(token, encoding="utf-8")
    try:
        check = ray.remote(num_cpus=0)(_reads)
        refs = {
            n["NodeManagerAddress"]: check.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(probe), token)
            for n in nodes
        }
        blind = [addr for addr, ref in refs.items() if not ray.get(ref, timeout=60)]
    finally:
        probe.unlink(missing_ok=True)
    if blind:
        raise ClusterError(
            f"{what} {folder} is not shared: nodes {', '.join(sorted(blind))} do not see it. The cluster "
            f"has {len(nodes)} nodes; put {what} on storage every node mounts at the same path (NFS, a "
            "shared volume)")
