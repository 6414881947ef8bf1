#!/usr/bin/env bash
# down.sh: remove what up.sh made: the nodes' processes, the daemons (by pid file), the
# namespaces, links and bridge, the lines up.sh added to /etc/hosts and the /etc/slurm links.
#   BASE=/tmp/dtstudy-slurm2 tests/slurm/two_nodes/down.sh [--wipe]   (--wipe also deletes $BASE)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-/tmp/dtstudy-slurm2}
source "$HERE/../common.sh"   # stop, stop_accounting_and_munge
source "$HERE/cluster.env"
for node in "$NODE1" "$NODE2"; do
  stop "$BASE/run/slurmd.$node.pid"
  # what runs on the node still (a job's tasks): nothing may outlive its namespace
  ip netns list | grep -qw "$node" && BASE=$BASE bash "$HERE/node.sh" kill "$node"
done
stop "$BASE/run/slurmctld.pid"
stop_accounting_and_munge
for node in "$NODE1" "$NODE2"; do
  ip netns del "$node" 2>/dev/null
  ip link del "dtsv-$node" 2>/dev/null   # goes with the namespace; at once only on some kernels
done
ip link del "$BRIDGE" 2>/dev/null
# exactly the lines up.sh added; written in place (/etc/hosts may be a mount)
if grep -qF "$HOSTS_MARK" /etc/hosts; then
  kept=$(mktemp)
  grep -vF "$HOSTS_MARK" /etc/hosts > "$kept"
  cat "$kept" > /etc/hosts
  rm -f "$kept"
fi
[[ "${1:-}" == --wipe ]] && rm -rf "$BASE"
echo "down.sh: stopped and removed (BASE=$BASE)"
