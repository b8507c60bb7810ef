#!/usr/bin/env bash
# Fills .gpu/ (ignored by git) with what a device call carries: the wheels the device lacks (shared/gpu-wheels,
# see shared/GPU.md) and the shipped tokenizer's files (so gpu_job.py's outputs detokenize). Run it here, once:
#
#   bash benchmarks/gpu/carry.sh [WHEELS_DIR]      # default ../shared/gpu-wheels; then carry [".gpu"] on the device
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels="${1:-../shared/gpu-wheels}"
mkdir -p .gpu/wheels .gpu/tokenizer
cp "$wheels"/*.whl .gpu/wheels/
folder=$(python -c "from batchprefill.model.loader import resolve_folder; print(resolve_folder(None))")
cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json .gpu/tokenizer/  # the shipped GGUF's, converted once
du -sh .gpu
