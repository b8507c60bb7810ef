#!/usr/bin/env bash
# Stop a cluster that scripts/slurm-up.sh DIR started: cancel its jobs, then TERM each daemon by the PID in
# its pid file (KILL after 10 s). Only processes whose command line names DIR's config are signalled.
set -euo pipefail

dir=${1:?usage: slurm-down.sh DIR}
dir=$(cd "$dir" && pwd)
export SLURM_CONF="$dir/slurm.conf"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

ours() {  # the daemon's PID when its pid file names a live process started with this config
  local pid
  pid=$(cat "$dir/$1.pid" 2>/dev/null) || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$SLURM_CONF" && echo "$pid"
}

if ours slurmctld >/dev/null; then
  timeout 10 squeue -h -o %A 2>/dev/null | sort -u | xargs -r timeout 10 scancel 2>/dev/null || true
  for _ in $(seq 1 20); do  # let slurmd end the jobs' processes while it still runs
    [ -z "$(timeout 5 squeue -h -t RUNNING,COMPLETING -o %A 2>/dev/null)" ] && break
    sleep 0.5
  done
fi

for daemon in slurmd slurmctld; do
  pid=$(ours "$daemon") || continue
  as_root kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    as_root kill -KILL "$pid" 2>/dev/null || true
  fi
done
echo "slurm-down: stopped the cluster in $dir" >&2
