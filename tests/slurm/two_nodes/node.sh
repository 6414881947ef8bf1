#!/usr/bin/env bash
# node.sh: one node of the two-node cluster (tests/slurm/two_nodes/up.sh made its namespace).
#   node.sh start NODE    its slurmd, in the node's network namespace with the node's host name
#   node.sh kill NODE     every process of the node at once (SIGKILL): the node is lost
#   node.sh cut NODE      its link cut (the node's processes run on, unreachable); `mend` restores it
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-/tmp/dtstudy-slurm2}
source "$HERE/cluster.env"
what=$1 node=$2
[[ $node == "$NODE1" || $node == "$NODE2" ]] || { echo "node.sh: no node '$node' (nodes: $NODE1, $NODE2)" >&2; exit 2; }
export SLURM_CONF=$BASE/etc/slurm.conf
case $what in
  # a UTS namespace of its own: the node's host name, which the jobs' ranks report. nsenter,
  # not `ip netns exec`: that one mounts a /sys of its own, without /sys/fs/cgroup (slurmd needs it)
  start)
    mkdir -p "$BASE/spool/$node"
    nsenter --net="/run/netns/$node" unshare --uts sh -c "hostname $node && exec slurmd -N $node" ;;
  kill)
    pids=$(ip netns pids "$node")
    [[ -z $pids ]] || kill -9 $pids 2>/dev/null || true
    rm -f "$BASE/run/slurmd.$node.pid" ;;   # stale now: its number may go to another process
  cut) ip link set "dtsv-$node" down ;;
  mend) ip link set "dtsv-$node" up ;;
  *) echo "node.sh: start, kill, cut or mend, not '$what'" >&2; exit 2 ;;
esac
