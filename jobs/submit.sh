#!/usr/bin/env bash
# Submit a batchprefill job as a Slurm array of TASKS shards, then a merge that runs once all of them succeed.
#   jobs/submit.sh TASKS OUTPUT_DIR [overrides...]
#   e.g. SBATCH_GPUS_PER_TASK=1 jobs/submit.sh 8 /scratch/out data.input=/data/prompts.parquet
# sbatch takes further options from its environment (SBATCH_PARTITION, SBATCH_TIMELIMIT, SBATCH_ACCOUNT, ...).
# Logs go to OUTPUT_DIR/logs. Prints `array_job_id=...` and `merge_job_id=...`. If a task fails, the merge is
# cancelled: rerun that task (sbatch --array=<i> jobs/array.sbatch output.dir=OUTPUT_DIR [overrides]), which
# resumes, then the merge (jobs/merge.sbatch output.dir=OUTPUT_DIR [overrides]).
set -euo pipefail

tasks=${1:?usage: submit.sh TASKS OUTPUT_DIR [overrides...]}
out=$(realpath -m "${2:?usage: submit.sh TASKS OUTPUT_DIR [overrides...]}")
shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/logs"

array=$(sbatch --parsable --array="0-$((tasks - 1))" --output="$out/logs/%x-%A_%a.out" \
  "$here/array.sbatch" "output.dir=$out" "$@")
array=${array%%;*}  # --parsable prints "id;cluster" on federated setups
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
  --output="$out/logs/%x-%j.out" "$here/merge.sbatch" "output.dir=$out" "$@")
echo "array_job_id=$array"
echo "merge_job_id=${merge%%;*}"
