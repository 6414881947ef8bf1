# common.sh: what the tests' clusters share (sourced by tests/slurm/up.sh, the one-node
# SLURM, and tests/slurm/two_nodes/up.sh): waiting for a daemon, munged, and the accounting
# (MariaDB + slurmdbd) with everything under $BASE. Needs BASE set and $BASE/{munge,log,run,mysql}.

# wait_for WHAT SECONDS LOG CMD...: until CMD succeeds, by a wall-clock deadline, not a count of
# tries: on a busy 2-core CI machine a daemon has taken over 30 s to answer, and each probe
# may itself take seconds. Past the deadline: the error names WHAT and its log, and exits.
wait_for() {
  local what=$1 seconds=$2 log=$3; shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      echo "$(basename "$0"): $what did not answer within $seconds s; the end of $log:" >&2
      tail -5 "$log" >&2 || true; exit 1
    fi
    sleep 0.5
  done
}

# claim_etc_slurm: link /etc/slurm/{slurm,gres}.conf to this cluster's (Snakemake's jobstep
# plugin drops SLURM_CONF, so srun inside a job reads /etc/slurm/slurm.conf). Two of the tests'
# clusters cannot run at once: refuses while the links point to another cluster that runs.
claim_etc_slurm() {
  local other
  other=$(readlink /etc/slurm/slurm.conf 2>/dev/null || true)
  other=${other%/etc/slurm.conf}
  if [[ -n $other && $other != "$BASE" && -f $other/run/slurmctld.pid ]] \
     && kill -0 "$(cat "$other/run/slurmctld.pid")" 2>/dev/null; then
    echo "$(basename "$0"): the tests' SLURM under $other runs (it owns /etc/slurm/slurm.conf); stop it first (BASE=$other tests/slurm/down.sh, or tests/slurm/two_nodes/down.sh for the two-node one)" >&2
    exit 1
  fi
  mkdir -p /etc/slurm
  ln -sfn "$BASE/etc/slurm.conf" /etc/slurm/slurm.conf
  ln -sfn "$BASE/etc/gres.conf" /etc/slurm/gres.conf
}

# start_munge: munged with its own key and socket under $BASE/munge
start_munge() {
  local M=$BASE/munge
  chmod 755 "$M"   # munged: "execute permissions for all required" on its socket folder
  [[ -f $M/munge.key ]] || { dd if=/dev/urandom of="$M/munge.key" bs=1024 count=1 status=none; chmod 400 "$M/munge.key"; }
  munged --key-file="$M/munge.key" --socket="$M/munge.socket.2" --pid-file="$M/munged.pid" \
         --log-file="$BASE/log/munged.log" --seed-file="$M/munged.seed"
}

# start_accounting DB_PORT: MariaDB on 127.0.0.1:DB_PORT, then slurmdbd (its port is in
# $BASE/etc/slurmdbd.conf) and the cluster `ci` in it, which must exist before slurmctld starts
start_accounting() {
  local db_port=$1 D=$BASE/mysql
  if [[ ! -d $D/data ]]; then
    mariadb-install-db --no-defaults --datadir="$D/data" --user=root \
      --auth-root-authentication-method=socket --skip-test-db > "$BASE/log/mariadb-install.log" 2>&1
  fi
  nohup mariadbd --no-defaults --datadir="$D/data" --user=root --port="$db_port" --bind-address=127.0.0.1 \
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
  timeout 20 sacctmgr -i add cluster ci >/dev/null || true
}

# wait_idle NODE... : until every node is idle, by IDLE_WAIT_S, stopping at once if slurmctld
# dies (a node took over 30 s to register on a busy 2-core CI machine)
wait_idle() {
  local nodes; nodes=$(IFS=,; echo "$*")
  IDLE_WAIT_S=${IDLE_WAIT_S:-180}
  local deadline=$((SECONDS + IDLE_WAIT_S))
  until [[ "$(timeout 10 sinfo -h -n "$nodes" -o %T 2>/dev/null | sort -u)" == idle ]]; do
    kill -0 "$(cat "$BASE/run/slurmctld.pid" 2>/dev/null)" 2>/dev/null \
      || { echo "$(basename "$0"): slurmctld died:" >&2; tail -5 "$BASE/log/slurmctld.log" >&2; exit 1; }
    if (( SECONDS >= deadline )); then
      echo "$(basename "$0"): nodes $nodes not idle after ${IDLE_WAIT_S} s (IDLE_WAIT_S):" >&2
      sinfo -N -l >&2; tail -5 "$BASE"/log/slurmd*.log >&2; exit 1
    fi
    sleep 0.5
  done
}

# stop PIDFILE: the process it names, TERM then KILL after 10 s
stop() {
  [[ -f $1 ]] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

# stop_accounting_and_munge: the end of every down.sh, and the /etc/slurm links if they are ours
stop_accounting_and_munge() {
  stop "$BASE/run/slurmdbd.pid"
  stop "$BASE/run/mariadbd.pid"
  stop "$BASE/munge/munged.pid"
  local f
  for f in slurm.conf gres.conf; do
    [[ "$(readlink /etc/slurm/$f 2>/dev/null)" == "$BASE/etc/$f" ]] && rm -f "/etc/slurm/$f"
  done
  return 0
}
