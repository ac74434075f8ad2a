"""MKL's strict reproducibility mode in a Ray worker: the process imports rewardstack (to unpickle a
scoring actor's class, or a function of the package) before any torch work, which sets MKL_CBWR.

Part of the Ray unit (tests/ray_fixtures.py: one local cluster shared by the `test_ray_*` files).
"""

from __future__ import annotations

import pytest
import torch

from ray_fixtures import ray, shared_cluster
from rewardstack._reproducible import strict_state


@pytest.fixture(scope="module")
def cluster(request):  # noqa: ANN001, ANN201
    yield from shared_cluster(request)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_a_ray_worker_runs_mkl_in_strict_mode(cluster) -> None:  # noqa: ANN001
    # The worker starts without the driver's MKL_CBWR (this test process imported rewardstack, which
    # set it, and Ray's workers inherit the driver's environment): only its own import can set it.
    task = ray.remote(strict_state).options(num_cpus=0, runtime_env={"env_vars": {"MKL_CBWR": ""}})
    assert ray.get(task.remote(), timeout=300) == "on"
    unset = ray.remote(strict_state).options(num_cpus=0, runtime_env={"env_vars": {"MKL_CBWR": "",
                                                                                  "REWARDSTACK_MKL_STRICT": "0"}})
    assert ray.get(unset.remote(), timeout=300) == "off"  # the switch is read there too: the check can fail
