#!/usr/bin/env bash
# up.sh: a one-node SLURM on localhost for the tests (run as root; no systemd needed):
# munged, MariaDB + slurmdbd (accounting: sacct is how submitit and Snakemake see job
# states), slurmctld and slurmd, with eight fake GPUs. Configs, keys, sockets, spool, logs and
# the database all live under $BASE; the only writes outside it are the apt packages and the
# symlinks /etc/slurm/{slurm,gres}.conf (Snakemake's jobstep plugin drops SLURM_CONF).
#   BASE=/tmp/dtstudy-slurm tests/slurm/up.sh      stop with tests/slurm/down.sh
# Adapted from ../shared/reference/slurm-localhost (NOTES.md there lists the pitfalls).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-/tmp/dtstudy-slurm}
HOST=$(hostname -s)
t0=$(date +%s.%N)
[[ $(id -u) == 0 ]] || { echo "up.sh: run as root (it starts slurmd, slurmctld, slurmdbd, mariadbd, munged)" >&2; exit 1; }

source "$HERE/common.sh"   # wait_for, claim_etc_slurm, start_munge, start_accounting, wait_idle

# 0) Packages (tests/slurm/install.sh, also run by .ci/run)
bash "$HERE/install.sh"

if [[ -f $BASE/run/slurmctld.pid ]] && kill -0 "$(cat "$BASE/run/slurmctld.pid")" 2>/dev/null; then
  echo "up.sh: SLURM already running under $BASE"; exit 0
fi
mkdir -p "$BASE"/{etc,munge,run,spool/ctld,spool/d,log,fakegpu,mysql}

# 1) Configs from the templates next to this script
HW=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ UpTime.*//')
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$HW")
HW=$(sed "s/RealMemory=$MEM/RealMemory=$((MEM * 95 / 100))/" <<<"$HW")   # a bit of headroom
# The node claims $CPUS cores whatever it has (SlurmdParameters=config_overrides): a 2-core CI
# machine then runs a job of N workers + shards as one node, which it cannot do with
# --ntasks-per-node above its cores, even with --overcommit.
CPUS=${CPUS:-8}
HW=$(sed -E "s/CPUs=[0-9]+/CPUs=$CPUS/; s/Boards=[0-9]+/Boards=1/; s/SocketsPerBoard=[0-9]+/SocketsPerBoard=1/; s/CoresPerSocket=[0-9]+/CoresPerSocket=$CPUS/; s/ThreadsPerCore=[0-9]+/ThreadsPerCore=1/" <<<"$HW")
fill() { sed -e "s|@BASE@|$BASE|g" -e "s|@HOST@|$HOST|g" -e "s|@NODE_HW@|$HW|g" "$HERE/$1" > "$BASE/etc/$1"; }
fill slurm.conf
fill gres.conf
fill slurmdbd.conf; chmod 600 "$BASE/etc/slurmdbd.conf"
claim_etc_slurm
export SLURM_CONF=$BASE/etc/slurm.conf

# 2) Fake GPUs: char devices with /dev/null's numbers (a gres needs a real device file)
for i in 0 1 2 3 4 5 6 7; do [[ -e $BASE/fakegpu/nvidia$i ]] || mknod "$BASE/fakegpu/nvidia$i" c 1 3; done

# 3) munged with its own key and socket
start_munge

# 4) Accounting: MariaDB on 127.0.0.1:13306, slurmdbd on 16819
start_accounting 13306

# 5) slurmctld + slurmd; wait for the node to be idle
slurmctld
slurmd
wait_idle "$HOST"
sinfo
echo "SLURM up in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (BASE=$BASE)"
