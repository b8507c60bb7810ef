#!/usr/bin/env bash
# Kernel and engine benchmark on one GPU (about 5 minutes on an H200): sbatch jobs/gpu_benchmark.sh [--out PATH]
# Runs from any folder. The repo is the one holding this script; under sbatch, which runs a spooled copy,
# the one holding the script Slurm recorded for the job, else the submit folder; BATCHPREFILL_REPO overrides
# all. A relative --out is taken from the repo root.
#SBATCH --job-name=batchprefill-gpu-bench
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=4
#SBATCH --time=00:15:00
#SBATCH --output=gpu_benchmark_%j.log
set -euo pipefail

repo_at() {  # prints the absolute repo path when $1 is the repo
  [[ -n "$1" && -f "$1/benchmarks/gpu/gpu.py" ]] && (cd "$1" && pwd)
}

candidates=("${BATCHPREFILL_REPO:-}" "$(dirname "${BASH_SOURCE[0]}")/..")
if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scontrol >/dev/null; then
  submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1)
  [[ -n "$submitted" ]] && candidates+=("$(dirname "$submitted")/..")
fi
candidates+=("${SLURM_SUBMIT_DIR:-}")

for candidate in "${candidates[@]}"; do
  if repo=$(repo_at "$candidate"); then
    cd "$repo"
    export PYTHONUNBUFFERED=1
    exec python benchmarks/gpu/gpu.py "$@"
  fi
done
echo "gpu_benchmark.sh: no batchprefill repo (benchmarks/gpu/gpu.py) beside this script or in the submit folder;" \
     "set BATCHPREFILL_REPO=/path/to/batchprefill" >&2
exit 2
