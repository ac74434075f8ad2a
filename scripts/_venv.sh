# Sourced by the scripts beside it: makes ./.venv with the CPU build of torch and rewardstack installed.
# GPU users: install your CUDA build of torch into the venv first; a torch already there is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# The client first: rewardstack depends on it (`rewardstack-client`), and it is not on the index.
.venv/bin/pip install --quiet --disable-pip-version-check -e ./clients/python -e ".[$1]"
