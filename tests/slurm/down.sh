#!/usr/bin/env bash
# down.sh: stop what up.sh started, by pid file, in reverse order.
#   BASE=/tmp/dtstudy-slurm tests/slurm/down.sh [--wipe]   (--wipe also deletes $BASE)
set -uo pipefail
BASE=${BASE:-/tmp/dtstudy-slurm}
source "$(cd "$(dirname "$0")" && pwd)/common.sh"   # stop, stop_accounting_and_munge
stop "$BASE/run/slurmd.pid"      # jobs still running end with it
stop "$BASE/run/slurmctld.pid"   # also ends its child slurmscriptd
stop_accounting_and_munge
[[ "${1:-}" == --wipe ]] && rm -rf "$BASE"
echo "down.sh: stopped (BASE=$BASE)"
