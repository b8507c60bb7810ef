#!/usr/bin/env bash
# Kernel benchmark on one GPU (under 5 minutes): sbatch jobs/gpu_benchmark.sh [--out PATH]
#SBATCH --job-name=batchprefill-gpu-bench
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=4
#SBATCH --time=00:15:00
#SBATCH --output=gpu_benchmark_%j.log
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export PYTHONUNBUFFERED=1
exec python benchmarks/gpu.py "$@"
