"""Distinct cores for a timed run: leases (lock files) and pinning, and what a run records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import train_run
from dtstudy.launch import cores

CORES = len(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(CORES < 2, reason="needs 2 cores")


@pytest.fixture
def private_leases(tmp_path, monkeypatch):
    monkeypatch.setenv(cores.LEASE_DIR_ENV, str(tmp_path / "leases"))


@needs_two
def test_leases_are_distinct_and_exhaustible(private_leases):
    first = cores.lease(CORES - 1)
    assert first is not None and len(set(first.cores)) == CORES - 1
    second = cores.lease(1)
    assert second is not None and second.cores[0] not in first.cores
    assert cores.lease(1) is None  # every core is held
    second.release()
    third = cores.lease(1)
    assert third is not None and third.cores == second.cores
    assert cores.lease(CORES + 1) is None


def test_a_killed_holder_frees_its_cores(private_leases, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dtstudy.launch import cores; "
         f"held = cores.lease({CORES}); print(held.cores, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert holder.stdout.readline().strip() == str(sorted(os.sched_getaffinity(0)))
        assert cores.lease(1) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    again = cores.lease(CORES)
    assert again is not None


@needs_two
def test_a_run_pins_each_rank_to_its_own_core(tmp_path, tiny_data):
    """Through the warm pool (the local default): rank 0 runs on one core, the run's two
    ranks on two distinct ones, and metrics.json says which."""
    metrics, _, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=6)
    environment = metrics["environment"]
    pinned = environment["pinned_cores"]
    if pinned is None:  # another study on this machine holds cores now: nothing to check
        pytest.skip("the machine's cores are leased by another run")
    assert len(pinned) == 2 and len(set(pinned)) == 2
    assert environment["affinity"] == [pinned[0]]
    assert not environment["oversubscribed"] and environment["cores"] == os.cpu_count()


@needs_two
def test_a_run_with_no_free_core_is_not_pinned_and_says_so(tmp_path, tiny_data):
    held = cores.lease(CORES)  # the machine's own lease folder: what the pool uses
    if held is None:
        pytest.skip("the machine's cores are leased by another run")
    try:
        metrics, _, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=6)
    finally:
        held.release()
    assert metrics["environment"]["pinned_cores"] is None
    assert len(metrics["environment"]["affinity"]) == CORES
