#!/usr/bin/env bash
# The Debian packages of the tests' SLURM clusters (tests/slurm/up.sh, two_nodes/up.sh); idempotent.
set -euo pipefail
missing=""
command -v slurmctld >/dev/null || missing="$missing slurm-wlm"
command -v munged >/dev/null || missing="$missing munge"
command -v slurmdbd >/dev/null || missing="$missing slurmdbd"
command -v mariadbd >/dev/null || missing="$missing mariadb-server"
command -v ip >/dev/null || missing="$missing iproute2"   # the two-node cluster's namespaces and bridge
[[ -z $missing ]] && exit 0
sudo=""; [[ $(id -u) == 0 ]] || sudo="sudo"
echo "install.sh: installing$missing (apt)"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
