#!/usr/bin/env bash
# Install rewardstack with its test dependencies in ./.venv (CPU build of torch), check the import
# layers (docs/CONTRACT.md, contracts in pyproject.toml) and run the suite.
source "$(dirname "$0")/_venv.sh" test
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q "$@"
