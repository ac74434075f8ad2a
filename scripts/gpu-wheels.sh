#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the GPU check needs that the card's image
# lacks (scripts/gpu-carry.txt), for the card's python (3.12, manylinux x86_64), into .whl/ (ignored
# by git); names given as arguments come too. Then: run(command="bash scripts/gpu-check.sh",
# carry=[".whl"]) (docs/GPU.md). Versions are resolved together, so pydantic and pydantic-core match.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t names < <(grep -v '^#' scripts/gpu-carry.txt | grep -v '^ *$')
names+=("$@")  # more for another script on the card (scripts/gpu-trainers.sh: the server's packages)
mkdir -p .whl
# The same pip line the preflight prints for a missing wheel (gpu_preflight.download_command), with deps.
cmd=$(python3 -c 'import sys; sys.path.insert(0, "scripts"); from gpu_preflight import download_command
print(download_command(sys.argv[1:], deps=True))' "${names[@]}")
$cmd --quiet --disable-pip-version-check
ls .whl
