#!/usr/bin/env bash
# Install rewardstack with its test dependencies in ./.venv (CPU build of torch) and run the suite.
source "$(dirname "$0")/_venv.sh" test
exec .venv/bin/python -m pytest -q "$@"
