#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the GPU check needs that the card's image
# lacks (scripts/gpu-carry.txt), for the card's python (3.12, manylinux x86_64), into .whl/ (ignored
# by git). Then: run(command="bash scripts/gpu-check.sh", carry=[".whl"]) (docs/GPU.md). Versions are
# resolved together, so pydantic and pydantic-core match.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t names < <(grep -v '^#' scripts/gpu-carry.txt | grep -v '^ *$')
mkdir -p .whl
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${names[@]}"
ls .whl
