"""The config a Ray worker runs (rescore's worker actors, Serve's replicas): its device follows its GPUs."""

from __future__ import annotations

from rewardstack.config import StackConfig


def worker_config(config: StackConfig, gpus_per_worker: float) -> StackConfig:
    """The config a Ray worker (rescore actor, Serve replica) runs: its device follows its GPUs.

    With no GPU reserved the stack runs on CPU (a worker must not use a card it did not reserve);
    with a share of a card (G < 1, several workers per card) the budget shrinks to that share.
    """
    if gpus_per_worker <= 0:
        return config.model_copy(update={"device": "cpu"})
    device = config.device if config.device.startswith("cuda") else "cuda"
    share = min(1.0, gpus_per_worker)
    return config.model_copy(update={"device": device, "gpu_utilization": config.gpu_utilization * share})
