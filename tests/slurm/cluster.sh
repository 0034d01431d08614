#!/usr/bin/env bash
# A throw-away single-node SLURM cluster for tests: state, spool, logs and pid files live
# under one folder. The config is written there and copied to /etc/slurm/, because the
# executor plugin's job step strips SLURM_* (SLURM_CONF too) before its nested `srun`,
# which then only finds the default path. A slurm.conf there that this script did not
# write (no MARK line) is never overwritten: start refuses (exit 6) instead.
#
#   tests/slurm/cluster.sh start DIR   # writes DIR/slurm.conf, starts both daemons, waits for idle
#   tests/slurm/cluster.sh stop DIR    # kills the daemons that `start DIR` recorded
#   export SLURM_CONF=DIR/slurm.conf   # then sbatch/squeue/sinfo talk to it
#
# No munge and no slurmdbd: AuthType=auth/none, accounting off (so no sacct history;
# MinJobAge=300 keeps finished jobs visible to squeue/scontrol for five minutes).
# Two fake GPUs of type h200 (PKV_SLURM_GPUS, PKV_SLURM_GPU_TYPE) so that the measuring
# rules' `--gpus=1` (or `--gpus=h200:1` when pinned) requests are scheduled by SLURM as on
# a GPU node: at most one job per GPU at a time.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there; not every root PATH has it

cmd=${1:?usage: cluster.sh start|stop DIR}
dir=${2:?usage: cluster.sh start|stop DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

MARK="# written by pkv tests/slurm/cluster.sh"
ETC=/etc/slurm

ours() { [ ! -e "$1" ] || head -n1 "$1" | grep -qxF "$MARK"; }

stop() {
  # Only the pids this script recorded; never by process name.
  for name in slurmd slurmctld; do
    pidf="$dir/$name.launcher.pid"
    [ -f "$pidf" ] || continue
    pid=$(cat "$pidf")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidf"
  done
  # Remove the published config only if it is ours and points at this folder.
  if [ -f "$ETC/slurm.conf" ] && ours "$ETC/slurm.conf" && grep -qF "StateSaveLocation=$dir/state" "$ETC/slurm.conf"; then
    rm -f "$ETC/slurm.conf" "$ETC/gres.conf"
  fi
}

start() {
  for exe in slurmctld slurmd sinfo sbatch squeue scontrol; do
    command -v "$exe" >/dev/null || { echo "cluster.sh: $exe not installed" >&2; exit 3; }
  done
  for f in "$ETC/slurm.conf" "$ETC/gres.conf"; do
    ours "$f" || { echo "cluster.sh: $f exists and was not written by this script; not touching it" >&2; exit 6; }
  done
  stop  # a previous start in the same folder
  rm -rf "$dir/state" "$dir/spool"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"

  local host node_line ctld_port slurmd_port
  local gpu_type=${PKV_SLURM_GPU_TYPE:-h200} ngpus=${PKV_SLURM_GPUS:-2} gpu_files
  # One character device per fake GPU (slurmd counts them); nothing ever opens them.
  gpu_files=$(printf '/dev/null,/dev/zero,/dev/full,/dev/random,/dev/urandom' | cut -d, -f1-"$ngpus")
  host=$(hostname -s)
  # slurmd -C reports this machine's real CPUs/sockets/memory; a node configured with
  # more than it has would be drained ("Low RealMemory").
  node_line=$(slurmd -C | head -n1)
  ctld_port=$(free_port)
  slurmd_port=$(free_port)

  cat > "$dir/slurm.conf" <<EOF
$MARK
ClusterName=pkvtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=${PKV_SLURMD_DEBUG:-info}
$node_line NodeAddr=127.0.0.1 Gres=gpu:$gpu_type:$ngpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # slurmd drops file-less GPUs, so each fake one is a harmless character device: with
  # task/none no device cgroup is set up, the file only gives the GPU an identity.
  printf '%s\nNodeName=%s Name=gpu Type=%s File=%s\n' "$MARK" "$host" "$gpu_type" "$gpu_files" > "$dir/gres.conf"
  mkdir -p "$ETC"
  cp "$dir/slurm.conf" "$dir/gres.conf" "$ETC/"

  export SLURM_CONF="$dir/slurm.conf"
  # -D keeps them in the foreground of their own process (no systemd here); setsid so a
  # Ctrl-C in the caller's terminal does not reach them, and we record the pids to stop.
  setsid slurmctld -D -i >"$dir/log/slurmctld.out" 2>&1 < /dev/null &
  echo $! > "$dir/slurmctld.launcher.pid"
  setsid slurmd -D -N "$host" >"$dir/log/slurmd.out" 2>&1 < /dev/null &
  echo $! > "$dir/slurmd.launcher.pid"

  for _ in $(seq 120); do
    state=$(sinfo -h -N -n "$host" -o '%T' 2>/dev/null || true)
    if [ "$state" = idle ]; then
      echo "SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    for name in slurmctld slurmd; do
      kill -0 "$(cat "$dir/$name.launcher.pid")" 2>/dev/null || {
        echo "cluster.sh: $name exited; its log:" >&2; tail -n 20 "$dir/log/$name.out" "$dir/log/$name.log" >&2 2>/dev/null || true
        stop; exit 4; }
    done
    sleep 0.5
  done
  echo "cluster.sh: node never became idle (last state: '${state:-none}')" >&2
  tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 2>/dev/null || true
  stop
  exit 5
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
