#!/usr/bin/env bash
# The trainer routes' batching table (bench/trainers.py) on a lent card's machine: the OpenAssistant
# stand-in served as [rewards.oa], 64 one-sample /get_reward clients, batched against one request at
# a time, with the models on the machine's CPU and then on its GPU; then telemetry on and off on the
# GPU. Answers whether the 2-core bench machine's batching ratio holds where the clients do not share
# the server's cores, and what a trainer on a card sees. Prints the tables (and to $OUT when set).
#   here:   bash scripts/gpu-wheels.sh fastapi starlette uvicorn     # .whl/, the server's packages too
#           python -m bench.trainers --build-standin .bench-standins   # the stand-in the card scores with
#   card:   run(command="bash scripts/gpu-trainers.sh", carry=[".whl", ".bench-standins"])
# The card's image has no package index and no stand-in builder's tokenizer package, so both travel.
# A reward model of a trainer's own size (8B, bfloat16) is measured by `bash scripts/gpu-check.sh card`
# (scripts/gpu_card.py, docs/GPU.md): against the card's peak and its plain forward, with swaps.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
source scripts/_carried.sh
carried_wheels .whl
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
log=${OUT:+$OUT/gpu-trainers.log}
exec > >(tee ${log:+"$log"}) 2>&1
echo "gpu-trainers: $(date -u +%FT%RZ), $(nproc) CPU cores"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
devices=${GPU_TRAINERS_DEVICES:-cpu cuda}
for device in $devices; do
  "$PY" -m bench.trainers --standins .bench-standins --device "$device" --tables batching
  echo
done
last=${devices##* }
"$PY" -m bench.trainers --standins .bench-standins --device "$last" --tables telemetry --repeats 3 --requests 24
