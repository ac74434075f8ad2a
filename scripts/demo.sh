#!/usr/bin/env bash
# Install rewardstack in ./.venv (CPU build of torch) and run the demo on offline stand-in models.
source "$(dirname "$0")/_venv.sh" standins
exec .venv/bin/rewardstack demo "$@"
