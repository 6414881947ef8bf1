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

# wait_for WHAT SECONDS CMD...: until CMD succeeds, by a wall-clock deadline, not a count of
# tries: on a busy 2-core CI machine a daemon has taken over 30 s to answer, and each probe
# may itself take seconds. Past the deadline: the error names WHAT and its log, and exits.
wait_for() {
  local what=$1 seconds=$2 log=$3; shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      echo "up.sh: $what did not answer within $seconds s; the end of $log:" >&2
      tail -5 "$log" >&2 || true; exit 1
    fi
    sleep 0.5
  done
}

# 0) Packages (tests/slurm/install.sh, also run by .ci/run)
bash "$HERE/install.sh"

if [[ -f $BASE/run/slurmctld.pid ]] && kill -0 "$(cat "$BASE/run/slurmctld.pid")" 2>/dev/null; then
  echo "up.sh: SLURM already running under $BASE"; exit 0
fi
mkdir -p "$BASE"/{etc,munge,run,spool/ctld,spool/d,log,fakegpu,mysql}
chmod 755 "$BASE/munge"   # munged: "execute permissions for all required" on its socket folder

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
mkdir -p /etc/slurm
ln -sfn "$BASE/etc/slurm.conf" /etc/slurm/slurm.conf
ln -sfn "$BASE/etc/gres.conf" /etc/slurm/gres.conf
export SLURM_CONF=$BASE/etc/slurm.conf

# 2) Fake GPUs: char devices with /dev/null's numbers (a gres needs a real device file)
for i in 0 1 2 3 4 5 6 7; do [[ -e $BASE/fakegpu/nvidia$i ]] || mknod "$BASE/fakegpu/nvidia$i" c 1 3; done

# 3) munged with its own key and socket
M=$BASE/munge
[[ -f $M/munge.key ]] || { dd if=/dev/urandom of="$M/munge.key" bs=1024 count=1 status=none; chmod 400 "$M/munge.key"; }
munged --key-file="$M/munge.key" --socket="$M/munge.socket.2" --pid-file="$M/munged.pid" \
       --log-file="$BASE/log/munged.log" --seed-file="$M/munged.seed"

# 4) Accounting: MariaDB on 127.0.0.1:13306, slurmdbd on 16819
D=$BASE/mysql
if [[ ! -d $D/data ]]; then
  mariadb-install-db --no-defaults --datadir="$D/data" --user=root \
    --auth-root-authentication-method=socket --skip-test-db > "$BASE/log/mariadb-install.log" 2>&1
fi
nohup mariadbd --no-defaults --datadir="$D/data" --user=root --port=13306 --bind-address=127.0.0.1 \
  --socket="$D/mysqld.sock" --pid-file="$BASE/run/mariadbd.pid" --log-error="$BASE/log/mariadb.err" \
  --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 >/dev/null 2>&1 &
DAEMON_WAIT_S=${DAEMON_WAIT_S:-120}
wait_for MariaDB "$DAEMON_WAIT_S" "$BASE/log/mariadb.err" timeout 10 mariadb-admin --no-defaults -S "$D/mysqld.sock" -u root ping
mariadb --no-defaults -S "$D/mysqld.sock" -u root -e "
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
slurmdbd
wait_for slurmdbd "$DAEMON_WAIT_S" "$BASE/log/slurmdbd.log" timeout 10 sacctmgr -n list cluster
timeout 20 sacctmgr -i add cluster ci >/dev/null || true   # must exist before slurmctld starts

# 5) slurmctld + slurmd; wait for the node to be idle
slurmctld
slurmd
# By a deadline, as wait_for, and stopping at once if slurmctld dies (the node took over 30 s
# to register on a busy 2-core CI machine).
IDLE_WAIT_S=${IDLE_WAIT_S:-180}
node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null || true; }
deadline=$((SECONDS + IDLE_WAIT_S))
until [[ "$(node_state)" == idle ]]; do
  kill -0 "$(cat "$BASE/run/slurmctld.pid" 2>/dev/null)" 2>/dev/null \
    || { echo "up.sh: slurmctld died:" >&2; tail -5 "$BASE/log/slurmctld.log" >&2; exit 1; }
  if (( SECONDS >= deadline )); then
    echo "up.sh: node $HOST not idle after ${IDLE_WAIT_S} s (IDLE_WAIT_S):" >&2
    sinfo -N -l >&2; tail -5 "$BASE/log/slurmd.log" >&2; exit 1
  fi
  sleep 0.5
done
sinfo
echo "SLURM up in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (BASE=$BASE)"
