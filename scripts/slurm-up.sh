#!/usr/bin/env bash
# Start a throwaway single-node Slurm from Debian's packages, for tests and for trying jobs/ by hand.
#   scripts/slurm-up.sh DIR      config, state, pid files and logs all under DIR
# Prints `export SLURM_CONF=DIR/slurm.conf` (clients find the cluster through it); stop with slurm-down.sh DIR.
# Installs the packages when missing (a fresh CI machine), needs root (or passwordless sudo) for that and for
# slurmd. Settings follow shared/SLURM.md: auth/none when Debian ships it (else munge), 90% of the memory slurmd
# detects (more drains the node), short scheduler and credential intervals so requeues restart in ~12 s.
set -euo pipefail

dir=${1:?usage: slurm-up.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
log() { echo "slurm-up: $*" >&2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=300 slurmctld slurmd slurm-client munge >&2
fi

# Ports: Slurm's defaults unless another cluster (another test run) holds them; then the next free pair.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=6817
while listening "$port" || listening $((port + 1)); do
  port=$((port + 2))
  [ "$port" -lt 6917 ] || { log "no free port pair in 6817-6916"; exit 1; }
done

if ls /usr/lib/*/slurm-wlm/auth_none.so /usr/lib/slurm/auth_none.so >/dev/null 2>&1; then
  auth="AuthType=auth/none
CredType=cred/none"
else  # munge: one daemon per machine, shared by every cluster on it
  auth="AuthType=auth/munge
CredType=cred/munge"
  if ! pgrep -u munge munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || as_root mungekey --create
    as_root install -d -o munge -g munge -m 0755 /run/munge
    as_root runuser -u munge -- /usr/sbin/munged
  fi
fi

cpus=$(nproc)
detected=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1)
memory=$((${detected:-1024} * 9 / 10))
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<EOF
ClusterName=bptest
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
$auth
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=2
DependencyParameters=kill_invalid_depend
ReturnToService=2
MinJobAge=600
KillWait=15
MailProg=/bin/true
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

export SLURM_CONF="$dir/slurm.conf"
as_root slurmctld -i -f "$SLURM_CONF"
as_root slurmd -N localhost -f "$SLURM_CONF"

for _ in $(seq 1 120); do
  state=$(timeout 5 sinfo -h -o %T 2>/dev/null || true)
  if [ "$state" = idle ]; then
    log "cluster up (ports $port-$((port + 1)), $cpus CPUs, ${memory} MB)"
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
log "the node never became idle (state: ${state:-none}); last log lines:"
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
