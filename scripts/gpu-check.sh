#!/usr/bin/env bash
# The GPU check of the memory simulation (scripts/gpu_check.py): full-size default models with random
# weights on a card capped at 40 GiB (the lent card may be larger), measured peaks within 15% of the
# simulation, a heavy-tailed workload with zero OOM, and the unbounded reference call OOMing where
# the simulation says. Under 10 minutes on one card; prints every figure; exits 1 on any failure.
#   bash scripts/gpu-check.sh                 # on a GPU machine (CUDA build of torch in .venv)
#   bash scripts/gpu-check.sh --dry-run       # the CPU parts only (simulate and plan; no GPU)
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" test
# The allocator rewardstack sets before CUDA starts (memory/allocator.py), unless one is given.
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
exec timeout 580 .venv/bin/python scripts/gpu_check.py --device-memory "${DEVICE_MEMORY:-40GiB}" "$@"
