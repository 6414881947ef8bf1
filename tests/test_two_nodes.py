"""The study on a two-node SLURM on one machine (tests/slurm/two_nodes/up.sh): each node a
network namespace with its own host name and address on a private bridge, slurmctld, the
accounting and the login side (Snakemake, the MLflow server) in the root namespace. What only
several nodes exercise: the rendezvous across hosts, the runs' ranks on two hosts, a node lost,
the tracking server reached from the nodes by name."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slurm

TWO_NODES = REPO / "tests" / "slurm" / "two_nodes"


def cluster_names() -> dict[str, str]:
    """tests/slurm/two_nodes/cluster.env: the nodes' and the login side's names and addresses."""
    names = {}
    for line in (TWO_NODES / "cluster.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            names[key] = value.strip('"')
    return names


CLUSTER = cluster_names()
NODES = [CLUSTER["NODE1"], CLUSTER["NODE2"]]


def namespaces_refused() -> str | None:
    """Why this machine cannot make the cluster's network namespaces; None when it can."""
    if os.geteuid() != 0:
        return "the two-node SLURM makes network namespaces and starts its daemons as root"
    probe = subprocess.run(["ip", "netns", "add", "dtstudy-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no network namespaces here: `ip netns add` said {probe.stderr.strip()!r}"
    subprocess.run(["ip", "netns", "del", "dtstudy-probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def two_nodes():
    """The two-node SLURM of tests/slurm/two_nodes (kept running if it was already up); it
    cannot run beside the one-node cluster of tests/test_slurm.py, whose module fixture stops
    it when that module ends."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    up = subprocess.run(["bash", str(TWO_NODES / "up.sh")], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    yield CLUSTER
    if "already runs" not in up.stdout:
        down = subprocess.run(["bash", str(TWO_NODES / "down.sh")], capture_output=True, text=True)
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_job_of_two_nodes_runs_on_two_hosts_that_reach_each_other(two_nodes):
    """srun over both nodes: one task on each, each with its node's host name and address, and
    each reaching the other node and the login side by name (a TCP connection to the other's
    slurmd port and to slurmctld's)."""
    probe = ("import socket; me = socket.gethostname(); "
             f"peer = {{'{NODES[0]}': '{NODES[1]}', '{NODES[1]}': '{NODES[0]}'}}[me]; "
             f"socket.create_connection((peer, 16828), timeout=5).close(); "
             f"socket.create_connection(('{two_nodes['LOGIN']}', 16827), timeout=5).close(); "
             "print(me, socket.gethostbyname(me), peer)")
    tasks = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", "python3", "-c", probe],
                           capture_output=True, text=True, timeout=120)
    assert tasks.returncode == 0, tasks.stdout + tasks.stderr
    seen = sorted(tuple(line.split()) for line in tasks.stdout.splitlines())
    assert seen == [(NODES[0], two_nodes["NODE1_ADDR"], NODES[1]), (NODES[1], two_nodes["NODE2_ADDR"], NODES[0])]
