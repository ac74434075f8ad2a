#!/usr/bin/env bash
# The GPU check of the memory layer (scripts/gpu_check.py): full-size default models with random
# weights on a card capped at 40 GiB (the lent card may be larger), measured peaks within 15% of the
# simulation, a heavy-tailed workload with zero OOM, the unbounded reference call OOMing where the
# simulation says, swaps that complete, recovery from a real CUDA OOM with nothing lost. Under 8
# minutes on one card; prints every figure as its phase ends (and to $OUT when set); exits 1 on any
# failed threshold, 3 when this python lacks a package (with the list of wheels to carry).
#   bash scripts/gpu-check.sh                 # on a GPU machine (see docs/GPU.md for the one command)
#   bash scripts/gpu-check.sh --dry-run       # the CPU parts only (simulate and plan; no GPU)
#   bash scripts/gpu-check.sh card            # a trainer's card: the pinned-swap path's CUDA tests, then
#                                             # scripts/gpu_card.py (an 8B reward model served and measured)
#   bash scripts/gpu-check.sh card --rehearse # the same steps on CPU with tiny dimensions
#
# Which python: the machine's own `python3` (or $PYTHON) when it imports a CUDA build of torch that
# sees a device: no venv, no pip from a registry, the project from this working tree (PYTHONPATH),
# and any wheels in .whl/ installed with --no-index. Otherwise (a CPU machine, or a GPU machine
# with a network and no CUDA torch of its own) the venv of scripts/_venv.sh. REWARDSTACK_GPU_CHECK_MODE
# (image or venv) forces one; tests/test_gpu_rehearsal.py forces `image` on CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
mode=${REWARDSTACK_GPU_CHECK_MODE:-}
if [ -z "$mode" ]; then
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null; then
    mode=image
  else
    mode=venv
  fi
fi
case "$mode" in
  image)
    source scripts/_carried.sh
    carried_wheels "${GPU_CHECK_WHEELS:-.whl}"  # the rehearsal points this elsewhere: it links the carried packages itself
    # The working tree's rewardstack first: nothing of the project is installed on the image.
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    ;;
  venv)
    source scripts/_venv.sh test
    PY=.venv/bin/python
    ;;
  *) echo "REWARDSTACK_GPU_CHECK_MODE must be image or venv, not '$mode'" >&2; exit 2 ;;
esac
# The allocator rewardstack sets before CUDA starts (memory/allocator.py), unless one is given.
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
card() {
  # The CUDA tests of the pinned swaps and of the memory layer (skipped without a device; the stand-in
  # stack's test needs a package the card's image lacks), then the measurements; both always run.
  local tests=0 run=0
  "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/test_pinned_swaps.py tests/test_gpu.py \
    --deselect tests/test_gpu.py::test_stack_on_cuda_plans_batches_that_do_not_oom || tests=$?
  timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_card.py "$@" || run=$?
  echo "gpu-check card: CUDA tests exit $tests, measurements exit $run"
  if [ "$run" -ne 0 ]; then return "$run"; fi
  if [ "$tests" -ne 0 ]; then return 1; fi
}
check() {
  echo "gpu-check: mode $mode, python $PY, $(date -u +%Y-%m-%dT%H:%MZ)"
  "$PY" scripts/gpu_preflight.py || return $?
  if [ "${1:-}" = card ]; then
    shift
    card "$@"
    return $?
  fi
  # 8 minutes for the check itself, so one lease (15 minutes) leaves room for a rerun.
  timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py --device-memory "${DEVICE_MEMORY:-40GiB}" "$@"
}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  check "$@" 2>&1 | tee "$OUT/gpu-check.log"
  exit "${PIPESTATUS[0]}"
fi
check "$@"
