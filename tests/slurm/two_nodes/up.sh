#!/usr/bin/env bash
# up.sh: a two-node SLURM on one machine for the tests (run as root). Each node is a network
# namespace with a host name of its own (a UTS namespace) and an address on a private bridge
# (cluster.env); its slurmd runs there. slurmctld, the accounting (MariaDB + slurmdbd) and
# munged run in the root namespace, as the login side does (Snakemake, the MLflow server),
# reached by the nodes at the bridge's address. The namespaces split the network and the host
# name only: files (the job folders, munge's socket, the fake GPUs) are shared, as a cluster's
# shared file system is. Configs, state and logs live under $BASE; outside it, the bridge, the
# namespaces and their veth links, marked lines in /etc/hosts and the /etc/slurm links, all of
# which down.sh removes (so does a failed up.sh). It cannot run beside the one-node cluster
# of ../up.sh (common.sh: claim_etc_slurm).
#   BASE=/tmp/dtstudy-slurm2 tests/slurm/two_nodes/up.sh      stop with tests/slurm/two_nodes/down.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-/tmp/dtstudy-slurm2}
HOST=$(hostname -s)
t0=$(date +%s.%N)
[[ $(id -u) == 0 ]] || { echo "up.sh: run as root (it makes network namespaces and starts the SLURM daemons)" >&2; exit 1; }
source "$HERE/../common.sh"   # wait_for, claim_etc_slurm, start_munge, start_accounting, wait_idle
source "$HERE/cluster.env"

bash "$HERE/../install.sh"
if [[ -f $BASE/run/slurmctld.pid ]] && kill -0 "$(cat "$BASE/run/slurmctld.pid")" 2>/dev/null; then
  echo "up.sh: the two-node SLURM already runs under $BASE"; exit 0
fi
if ip link show "$BRIDGE" >/dev/null 2>&1 || ip netns list | grep -qw "$NODE1"; then
  echo "up.sh: $BRIDGE or namespace $NODE1 exists already (a cluster not stopped?): run $HERE/down.sh first" >&2; exit 1
fi
# from here on a failure removes whatever was made
trap 'rc=$?; if (( rc )); then echo "up.sh: failed, removing what it made" >&2; BASE=$BASE bash "$HERE/down.sh" >&2; fi' EXIT
mkdir -p "$BASE"/{etc,munge,run,spool/ctld,log,fakegpu,mysql}

# 1) The network: a bridge with the login side's address, each node a namespace on it
ip link add "$BRIDGE" type bridge
ip addr add "$LOGIN_ADDR/$PREFIX_LEN" dev "$BRIDGE"
ip link set "$BRIDGE" up
for node in "$NODE1" "$NODE2"; do
  addr=$([[ $node == "$NODE1" ]] && echo "$NODE1_ADDR" || echo "$NODE2_ADDR")
  ip netns add "$node"
  ip link add "dtsv-$node" type veth peer name eth0 netns "$node"
  ip link set "dtsv-$node" master "$BRIDGE"
  ip link set "dtsv-$node" up
  ip netns exec "$node" ip addr add "$addr/$PREFIX_LEN" dev eth0
  ip netns exec "$node" ip link set eth0 up
  ip netns exec "$node" ip link set lo up
done
# Names as a cluster's DNS gives them: every node and the login side resolve each other
# (/etc/hosts is shared by the namespaces). Appended in place, not replaced: it may be a mount.
printf '%s %s %s\n' "$LOGIN_ADDR" "$LOGIN" "$HOSTS_MARK" "$NODE1_ADDR" "$NODE1" "$HOSTS_MARK" \
  "$NODE2_ADDR" "$NODE2" "$HOSTS_MARK" >> /etc/hosts

# 2) Configs from the templates next to this script
HW=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ UpTime.*//')
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$HW")
HW=$(sed "s/RealMemory=$MEM/RealMemory=$((MEM * 45 / 100))/" <<<"$HW")   # two nodes, some headroom
CPUS=${CPUS:-8}   # claimed whatever the machine has, as ../up.sh does
HW=$(sed -E "s/CPUs=[0-9]+/CPUs=$CPUS/; s/Boards=[0-9]+/Boards=1/; s/SocketsPerBoard=[0-9]+/SocketsPerBoard=1/; s/CoresPerSocket=[0-9]+/CoresPerSocket=$CPUS/; s/ThreadsPerCore=[0-9]+/ThreadsPerCore=1/" <<<"$HW")
fill() {
  sed -e "s|@BASE@|$BASE|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_ADDR@|$LOGIN_ADDR|g" -e "s|@NODE_HW@|$HW|g" \
      -e "s|@NODE1@|$NODE1|g" -e "s|@NODE1_ADDR@|$NODE1_ADDR|g" -e "s|@NODE2@|$NODE2|g" -e "s|@NODE2_ADDR@|$NODE2_ADDR|g" \
      "$HERE/$1" > "$BASE/etc/$1"
}
fill slurm.conf
fill gres.conf
fill slurmdbd.conf; chmod 600 "$BASE/etc/slurmdbd.conf"
claim_etc_slurm
export SLURM_CONF=$BASE/etc/slurm.conf
for i in 0 1 2 3; do [[ -e $BASE/fakegpu/nvidia$i ]] || mknod "$BASE/fakegpu/nvidia$i" c 1 3; done

# 3) munged, the accounting (MariaDB on 127.0.0.1:13307, slurmdbd on 16829), slurmctld, the nodes
start_munge
start_accounting 13307
slurmctld
for node in "$NODE1" "$NODE2"; do BASE=$BASE bash "$HERE/node.sh" start "$node"; done
wait_idle "$NODE1" "$NODE2"
sinfo
echo "two-node SLURM up in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (BASE=$BASE)"
