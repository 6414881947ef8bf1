#!/usr/bin/env bash
# down.sh: stop what up.sh started, by pid file, in reverse order.
#   BASE=/tmp/dtstudy-slurm tests/slurm/down.sh [--wipe]   (--wipe also deletes $BASE)
set -uo pipefail
BASE=${BASE:-/tmp/dtstudy-slurm}
stop() {  # $1 = pid file
  [[ -f $1 ]] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}
stop "$BASE/run/slurmd.pid"      # jobs still running end with it
stop "$BASE/run/slurmctld.pid"   # also ends its child slurmscriptd
stop "$BASE/run/slurmdbd.pid"
stop "$BASE/run/mariadbd.pid"
stop "$BASE/munge/munged.pid"
# drop the /etc/slurm symlinks only if they point into this BASE
for f in slurm.conf gres.conf; do
  [[ "$(readlink /etc/slurm/$f 2>/dev/null)" == "$BASE/etc/$f" ]] && rm -f "/etc/slurm/$f"
done
[[ "${1:-}" == --wipe ]] && rm -rf "$BASE"
echo "down.sh: stopped (BASE=$BASE)"
