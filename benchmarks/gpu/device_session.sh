#!/usr/bin/env bash
# One device session's measurements, in the order the open issues need them, each under its own time limit and
# each result written under OUT as soon as it finishes (the device tool brings OUT back even when the call runs out
# of time). The figures of the last H200 session set the limits: gpu_job 150 s, gpu_fp8 under 60 (before it timed
# five ways and swept the widened kernel's tiles: about 12 more compiles), gpu.py 169 s; 560 s in all.
#
#   bash benchmarks/gpu/carry.sh                                   # here, once: fills .gpu/ (wheels, tokenizer)
#   run(command="bash benchmarks/gpu/device_session.sh", carry=[".gpu"], timeout_s=600)     # the device call
#   bash benchmarks/gpu/device_session.sh --smoke                  # here: every script's CPU smoke run
#
# OUT (the device tool sets it; default a new temporary folder) gets each script's JSON and log, and steps.txt:
# a line a script with its exit status and seconds. Copy the JSON you keep to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
smoke=()
if [[ "${1:-}" == "--smoke" ]]; then
  smoke=(--smoke)
  export TRITON_INTERPRET=1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl || { echo "device_session.sh: the wheels in .gpu/wheels did not install" >&2; exit 2; }
  export PYTHONPATH="$PWD:/tmp/site"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "${OUT:=$(mktemp -d)}/device.csv"
fi
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1
tokenizer=()
[[ -f .gpu/tokenizer/tokenizer.json ]] && tokenizer=(--tokenizer .gpu/tokenizer)

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND under LIMIT_S, its output in OUT/NAME.log
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  status=$?
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
  tail -n 3 "$OUT/$name.log"
}

# Issue 38: the shared-prefix job at default settings (engine loop, whole process, step breakdown, floors, HF).
step gpu_job 190 python benchmarks/gpu/gpu_job.py "${smoke[@]}" "${tokenizer[@]}" --out "$OUT/gpu_job.json"
# Issue 40: FP8 linear layers (per channel and in 128 x 128 blocks; widened, W8A8, and as a job runs them) against
# bfloat16 at Llama-3-8B's decode shapes, 1 to 512 tokens, then the widened kernel's tiles.
step gpu_fp8 130 python benchmarks/gpu/gpu_fp8.py "${smoke[@]}" --out "$OUT/gpu_fp8.json"
# Every kernel's check and table (FP8 decode attention among them), then the end-to-end host-wait probe.
step gpu 240 python benchmarks/gpu/gpu.py "${smoke[@]}" --out "$OUT/gpu.json"
echo "device_session.sh: results in $OUT"
