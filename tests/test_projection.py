"""The alpha-beta performance model (dtstudy.perfmodel, each strategy spec's model_step, and
dtstudy.projection's calibration, hardware, project and layer_profiles): hand-computed cases
of every strategy's formula and of the wait-free-backprop timeline (specification tests:
they restate the model's formulas), the alpha-beta fit, straggler order statistics, bad
inputs, the layer profiles against torch's FLOP counter, the `project` command on a
measurement file alone, the band, and the validation against published scaling
(benchmarks/projection_validation.py, analytic). The model against this machine's measured
N=2 runs: timed by a benchmark (benchmarks/projection_on_machine.py, on a noisy machine);
its recorded rounds (benchmarks/records/) are held here against the model as the code now
stands, on throughput and on the exchange's seconds per step."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import random
import re
import statistics
import subprocess
import sys
from fractions import Fraction

import pytest
import yaml
from conftest import REPO, read_json

from dtstudy.errors import ConfigError
from dtstudy.perfmodel import collectives, steps, waits
from dtstudy.perfmodel.machine import NO_STRAGGLERS, LayerProfile, Link, Machine, Stragglers, Workload
from dtstudy.projection import calibration, hardware, layer_profiles, project
from dtstudy.strategies import spec as strategy_spec
from dtstudy.strategies import specs
from dtstudy.strategies.parameter_server.spec import PS_REQUEST_BYTES

WORKFLOW = str(REPO / "workflow")

# 1e6 parameters (4 MB of gradients), batch 10, 0.1 s of compute; 4 GPUs per node;
# inside: 10 us, 1 GB/s; between nodes: 100 us, 100 MB/s
W = Workload(
    parameters=1_000_000, bytes_per_parameter=4, batch=10, compute_s=0.1, measured_share={"allreduce_powersgd": 0.1}
)
MACHINE = Machine(gpus_per_node=4, intra=Link(1e-5, 1e9), inter=Link(1e-4, 1e8))


def knobs(name, **extra):
    params = dict(specs.knob_defaults()[name])
    if "shards" in params:
        params["placement"] = "colocated"
    return {**params, **extra}


def step_time(name, n, machine=MACHINE, workload=W, stragglers=NO_STRAGGLERS, **extra):
    return specs.model_step(name, workload, machine, n, knobs(name, **extra), stragglers)


# ----- specification tests: every strategy's formula, computed by hand ------------------------
# These tests, down to test_buckets_go_in_backprop_order, restate the model's own formulas
# (alpha-beta terms, bucket counts, the wait-free timeline) by hand: they catch a formula
# changed by accident, not a formula that is wrong about a machine. The validation is held
# elsewhere: against this machine's recorded N=2 runs in
# test_the_model_predicts_the_recorded_n2_runs_of_this_machine and
# test_the_model_predicts_the_exchange_of_the_recorded_n2_runs, and against published
# scaling in benchmarks/projection_validation.py (test_the_validation_against_published_scaling_holds).
# N=8 = 2 nodes of 4. Hierarchical all-reduce of 4e6 bytes: inside 2*3*1e-5 + 2*(3/4)*4e6/1e9
# = 0.00606 s; across 2 nodes 2*1*1e-4 + 2*(1/2)*4e6/1e8 = 0.0402 s.
ALLREDUCE_8 = 0.00606 + 0.0402


def test_allreduce_hand_computed():
    s = step_time("allreduce", 8)
    assert s.exchange_s == pytest.approx(ALLREDUCE_8, rel=1e-9)
    assert s.step_s == pytest.approx(0.1 + ALLREDUCE_8, rel=1e-9)
    assert s.throughput == pytest.approx(80 / (0.1 + ALLREDUCE_8), rel=1e-9)
    assert step_time("allreduce", 1).throughput == pytest.approx(100.0)  # unwrapped: compute alone
    # overlap: a quarter of the compute (0.025 s) hides that much of the exchange
    overlapped = specs.model_step(
        "allreduce", W, Machine(4, MACHINE.intra, MACHINE.inter, overlap=0.25), 8, knobs("allreduce")
    )
    assert overlapped.exposed_s == pytest.approx(ALLREDUCE_8 - 0.025, rel=1e-9)
    # 2 buckets of 2 MiB: twice the latency terms
    two = step_time("allreduce", 8, bucket_cap_mb=2)
    assert two.exchange_s == pytest.approx(ALLREDUCE_8 + 6e-5 + 2e-4, rel=1e-9)


def test_flat_ring_allreduce_hand_computed():
    # one ring through all 8 GPUs of 2 nodes: 14 steps, 2 of them across nodes (1e-4), 12
    # inside (1e-5); 14/8 of the 4e6 bytes through the slowest link (1e8 B/s), all links at once
    ring = dataclasses.replace(MACHINE, allreduce_algorithm="ring")
    flat_8 = 12 * 1e-5 + 2 * 1e-4 + 14 / 8 * 4e6 / 1e8
    assert step_time("allreduce", 8, machine=ring).exchange_s == pytest.approx(flat_8, rel=1e-9)
    assert flat_8 != pytest.approx(ALLREDUCE_8, rel=1e-3)  # the two algorithms differ here
    # 64 GPUs, 16 nodes: 126 steps, 30 across; twice the messages with 2 MiB buckets
    flat_64 = 96 * 1e-5 + 30 * 1e-4
    assert collectives.allreduce_time(4e6, 64, ring, messages=2) == pytest.approx(
        2 * flat_64 + 126 / 64 * 4e6 / 1e8, rel=1e-9
    )
    # one node, or one GPU per node: both algorithms are the same plain ring
    assert collectives.allreduce_time(4e6, 4, ring) == pytest.approx(
        collectives.allreduce_time(4e6, 4, MACHINE), rel=1e-12
    )
    one_each = Machine(1, MACHINE.intra, MACHINE.inter)
    assert collectives.allreduce_time(
        4e6, 8, dataclasses.replace(one_each, allreduce_algorithm="ring")
    ) == pytest.approx(collectives.allreduce_time(4e6, 8, one_each), rel=1e-12)
    # what a profile says, checked
    machine, source, _ = hardware.machine_from_profile(
        {
            "name": "p",
            "gpus_per_node": 4,
            "allreduce_algorithm": "ring",
            "inter_node": {"bandwidth_gbit_s": 10, "latency_us": 5},
            "intra_node": {"bandwidth_gbyte_s": 10, "latency_us": 5},
        }
    )
    assert machine.allreduce_algorithm == "ring" and source["allreduce_algorithm"] == "profile"
    with pytest.raises(
        ConfigError, match=r"key 'allreduce_algorithm': 'tree' is not one of \['hierarchical', 'ring'\]"
    ):
        hardware.machine_from_profile(
            {
                "name": "p",
                "gpus_per_node": 4,
                "allreduce_algorithm": "tree",
                "inter_node": {"bandwidth_gbit_s": 10, "latency_us": 5},
            }
        )


def test_half_precision_hand_computed():
    # N=4, one node: 2e6 bytes: 6e-5 + 1.5 * 2e6 / 1e9 = 0.00306; casts: 3 passes of 4e6 at 10 GB/s
    machine = Machine(4, MACHINE.intra, MACHINE.inter, compression_bandwidth=1e10)
    for name in ("allreduce_fp16", "allreduce_bf16"):
        assert step_time(name, 4).exchange_s == pytest.approx(0.00306, rel=1e-9)
        assert step_time(name, 4, machine=machine).exchange_s == pytest.approx(0.00306 + 3 * 4e6 / 1e10, rel=1e-9)


def test_powersgd_hand_computed():
    # 10% of the bytes, three all-reduces (the whole tensors, P, Q) per bucket: 3*3*2*1e-5 + 1.5 * 4e5 / 1e9
    assert step_time("allreduce_powersgd", 4).exchange_s == pytest.approx(1.8e-4 + 6e-4, rel=1e-9)
    share = specs.AllReducePowerSGDSpec.sent_share
    assert share([[100, 100], [10, 1]], rank=2) == pytest.approx((400 + 10) / 10010)
    # torch compresses only when the factors are smaller by min_compression_rate (2): 10 x 10
    # goes as 2 x (10 + 10) = 40 values; 8 x 8 (32 x 2 = 64, not < 64) goes whole
    assert share([[10, 10], [8, 8]], rank=2) == pytest.approx((40 + 64) / 164)
    # without a measured share, the model's matrices at the run's rank knob: one 1000 x 1000
    # matrix (1e6 values) goes as 2 x 1000 x r values, 0.2% of the bytes at rank 2, 0.4% at 4;
    # the measured share wins over the matrices
    shaped = dataclasses.replace(W, measured_share={}, matrices=((1000, 1000),))
    for rank, sent in ((2, 0.004), (4, 0.008)):
        assert step_time("allreduce_powersgd", 4, workload=shaped, rank=rank).exchange_s == pytest.approx(
            1.8e-4 + 1.5 * sent * 4e6 / 1e9, rel=1e-9
        )
    measured = dataclasses.replace(W, matrices=((1000, 1000),))
    assert step_time("allreduce_powersgd", 4, workload=measured).exchange_s == pytest.approx(1.8e-4 + 6e-4, rel=1e-9)
    with pytest.raises(ValueError, match="matrices"):
        step_time("allreduce_powersgd", 4, workload=dataclasses.replace(W, measured_share={}))


def test_onebit_hand_computed():
    # message 1e6/8 bytes; all-gather inside 3*1e-5 + 3*125000/1e9, across 1e-4 + 4*125000/1e8;
    # 1e-9 s per byte: quantise once (half) + dequantise 8 messages (half each)
    machine = Machine(4, MACHINE.intra, MACHINE.inter, compression_s_per_byte={"allreduce_onebit": 1e-9})
    comm = 3e-5 + 3.75e-4 + 1e-4 + 5e-3
    assert step_time("allreduce_onebit", 8).exchange_s == pytest.approx(comm, rel=1e-9)
    assert step_time("allreduce_onebit", 8, machine=machine).exchange_s == pytest.approx(comm + 2e-3 * 9, rel=1e-9)
    # the levels: 3 tensors of 100 column groups; `column` (default) two fp32 means per group
    # (800 bytes more per message), `tensor` one fp32 scale per tensor (12)
    counted = dataclasses.replace(W, tensors=3, column_groups=100)
    for quantizer, message in (("column", 125_800), ("tensor", 125_012)):
        expected = 3e-5 + 3 * message / 1e9 + 1e-4 + 4 * message / 1e8
        assert step_time("allreduce_onebit", 8, workload=counted, quantizer=quantizer).exchange_s == pytest.approx(
            expected, rel=1e-9
        )


def test_parameter_server_hand_computed():
    # N=8, S=2 colocated, one shard per node: a node's NIC takes 4 remote workers' halves
    # (8e6) in and sends its 4 workers' halves (8e6) out, the 8 messages' latencies at once:
    # 1e-4 + 8e6/1e8 per phase
    phase = 1e-4 + 0.08
    sync = step_time("ps_sync", 8, shards=2)
    assert sync.exchange_s == pytest.approx(2 * phase, rel=1e-9)
    assert sync.step_s == pytest.approx(0.1 + 2 * phase, rel=1e-9)
    # one shard, dedicated: its NIC takes all 8 gradients: 1e-4 + 3.2e7/1e8
    dedicated = step_time("ps_sync", 8, shards=1, placement="dedicated")
    assert dedicated.exchange_s == pytest.approx(2 * (1e-4 + 0.32), rel=1e-9)
    assert dedicated.bound == "network"
    # dedicated shards are on nodes of their own: from one node of 4 workers, its NIC carries
    # their 4 M (1.6e7 bytes) each way, 1e-4 + 0.16 (not the link inside: 1e-5 + 0.016)
    assert step_time("ps_sync", 4, shards=1, placement="dedicated").exchange_s == pytest.approx(
        2 * (1e-4 + 0.16), rel=1e-9
    )
    # the shard's work: 8 sums + 4 update passes of its 2e6-byte slice at 0.1 GB/s, 20 ms
    # each; the sums start when the first push arrives, from a worker beside the shard
    # (1e-5 + 2e6/1e9 into the phase), so the phase's rest hides 0.0801 - 0.00201 s of them
    machine = Machine(4, MACHINE.intra, MACHINE.inter, server_bandwidth=1e8)
    assert step_time("ps_sync", 8, machine=machine, shards=2).server_s == pytest.approx(
        0.16 - (phase - 0.00201) + 0.08, rel=1e-9
    )
    # without stragglers backup workers cost what ps_sync costs
    assert step_time("ps_backup", 8, shards=2).step_s == pytest.approx(sync.step_s, rel=1e-12)
    # the protocol's own cost: once per worker round trip (the workers' run side by side)
    costly = dataclasses.replace(MACHINE, ps_request_s=0.003)
    for name in ("ps_sync", "ps_backup"):
        assert step_time(name, 8, machine=costly, shards=2).exchange_s == pytest.approx(2 * phase + 0.003, rel=1e-9)


def test_a_shard_sums_the_early_gradients_while_it_waits_for_the_slowest():
    # 20 ms a pass over a 2e6-byte slice at 0.1 GB/s; the push phase after the first arrival
    # hides 0.07809 s of the 8 sums (as above); a fixed straggler of 50 ms hides as much more,
    # so 0.16 - 0.12809 s of sums and the 80 ms update are left, not 0.24 s
    machine = Machine(4, MACHINE.intra, MACHINE.inter, server_bandwidth=1e8)
    in_phase = (1e-4 + 0.08) - (1e-5 + 2e-3)
    one_late = Stragglers(delay_s=0.05, distribution="fixed", count=1)
    assert step_time("ps_sync", 8, machine=machine, shards=2, stragglers=one_late).server_s == pytest.approx(
        0.16 - (in_phase + 0.05) + 0.08, rel=1e-9
    )
    late = Stragglers(delay_s=0.5, distribution="fixed", count=1)  # longer than the 8 sums: one pass left
    assert step_time("ps_sync", 8, machine=machine, shards=2, stragglers=late).server_s == pytest.approx(
        0.02 + 0.08, rel=1e-9
    )
    # backup k=1: the update takes the first 7 gradients only (the 8th is dropped unread)
    assert step_time("ps_backup", 8, machine=machine, shards=2, backup=1).server_s == pytest.approx(
        0.14 - in_phase + 0.08, rel=1e-9
    )
    # a dedicated shard's first push comes across (1e-4 + 4e6/1e8 of its one 4e6-byte slice)
    dedicated = step_time("ps_sync", 8, machine=machine, shards=1, placement="dedicated")
    assert dedicated.server_s == pytest.approx(0.32 - ((1e-4 + 0.32) - (1e-4 + 0.04)) + 0.16, rel=1e-9)


def test_ps_async_hand_computed():
    # a worker's unloaded round trip 2 (1e-4 + 4e6/1e8) = 0.0802; 8 workers each 10 images per
    # 0.1802 s; the links' round (0.0801, as one ps_sync phase) and the shards' answers, 8 of
    # a 2e6-byte half each (half inside the node: 1e-5 + 2e-3, half across: 1e-4 + 0.02), are
    # shorter: compute-bound
    s = step_time("ps_async", 8, shards=2)
    assert s.throughput == pytest.approx(80 / 0.1802, rel=1e-9)
    assert s.bound == "compute"
    # one dedicated shard: a round needs 3.2e7 bytes through its NIC (1e-4 + 0.32 s) and the
    # shard answers each of the 8 on its own, 8 (1e-4 + 4e6/1e8) = 0.3208 s: network-bound
    s = step_time("ps_async", 8, shards=1, placement="dedicated")
    assert s.throughput == pytest.approx(80 / 0.3208, rel=1e-9)
    assert s.bound == "network"
    # the shard's work: 5 passes (a sum, an update) of 4e6 bytes at 0.25 GB/s, 0.08 s a push,
    # 8 (0.08 + 0.0401) = 0.9608 s a round: server-bound (at 1 GB/s, 0.02 s a push, the
    # answers weigh more: network-bound)
    for bandwidth, round_s, bound in ((0.25e9, 0.9608, "server"), (1e9, 0.4808, "network")):
        machine = dataclasses.replace(MACHINE, server_bandwidth=bandwidth)
        s = step_time("ps_async", 8, machine=machine, shards=1, placement="dedicated")
        assert s.throughput == pytest.approx(80 / round_s, rel=1e-9)
        assert s.bound == bound
    # the protocol's cost lengthens each worker's cycle: 0.1 + 0.0802 + 0.003
    s = step_time("ps_async", 8, machine=dataclasses.replace(MACHINE, ps_request_s=0.003), shards=2)
    assert s.throughput == pytest.approx(80 / 0.1832, rel=1e-9)
    # SSP applies each push as ps_async does: without stragglers the same round
    for placement, shards in (("colocated", 2), ("dedicated", 1)):
        assert step_time("ssp", 8, shards=shards, placement=placement).step_s == pytest.approx(
            step_time("ps_async", 8, shards=shards, placement=placement).step_s, rel=1e-12
        )


def test_local_and_gossip_hand_computed():
    # local SGD: parameters + momentum (8e6 bytes) all-reduced every H=8 steps
    local = (6e-5 + 1.5 * 8e6 / 1e9) + (2e-4 + 8e6 / 1e8)
    assert step_time("local_sgd", 8).exchange_s == pytest.approx(local / 8, rel=1e-9)
    assert step_time("local_sgd", 8, period=2).exchange_s == pytest.approx(local / 2, rel=1e-9)
    assert step_time("easgd", 8).exchange_s == pytest.approx(ALLREDUCE_8 / 8, rel=1e-9)
    # gossip ring at N=8: 2 neighbours inside (1e-5 + 8e6/1e9); 2 crossings of each NIC (1e-4 + 8e6/1e8),
    # the messages sent at once (one latency)
    assert step_time("gossip", 8).exchange_s == pytest.approx(1e-4 + 0.08, rel=1e-9)
    assert step_time("gossip", 2).exchange_s == pytest.approx(1e-5 + 4e6 / 1e9, rel=1e-9)  # one peer at N=2
    assert steps.gossip_degree("random_pairs", 8) == 1
    # the averaging after the messages: a measured 1e-9 s per parameter byte (4e6 bytes) with
    # one neighbour, x (1 + 2) / 2 for the ring's two; else 11 passes at a profile's bandwidth
    timed = Machine(4, MACHINE.intra, MACHINE.inter, compression_s_per_byte={"gossip": 1e-9})
    assert step_time("gossip", 2, machine=timed).exchange_s == pytest.approx(1e-5 + 4e6 / 1e9 + 4e-3, rel=1e-9)
    assert step_time("gossip", 8, machine=timed).exchange_s == pytest.approx(1e-4 + 0.08 + 6e-3, rel=1e-9)
    passes = Machine(4, MACHINE.intra, MACHINE.inter, compression_bandwidth=1e11)
    assert step_time("gossip", 2, machine=passes).exchange_s == pytest.approx(
        1e-5 + 4e6 / 1e9 + 11 * 4e6 / 1e11, rel=1e-9
    )


def test_registry_matches_the_strategies():
    from dtstudy.strategies.registry import STRATEGIES

    assert set(specs.SPECS) == set(STRATEGIES)
    # the knobs a run really gets when it sets none (the registry's check fills the defaults)
    assert specs.knob_defaults() == {name: cls.check_params({}, 2) for name, cls in STRATEGIES.items()}
    # the parameter servers, as the calibration and the benchmarks tell them: the strategies whose
    # jobs start shard processes, and whose implementations talk to shards
    from dtstudy.strategies.parameter_server.strategy import ParameterServer
    from dtstudy.strategies.specs import PARAMETER_SERVERS, SPECS

    assert PARAMETER_SERVERS == {
        n for n, spec in SPECS.items() if spec.extra_processes(spec.placed_params(dict(spec.defaults), nodes=1), 1)
    }
    assert PARAMETER_SERVERS == {n for n, cls in STRATEGIES.items() if issubclass(cls, ParameterServer)}
    assert PARAMETER_SERVERS == {"ps_sync", "ps_backup", "ps_async", "ssp"}


# ----- the wait-free-backprop overlap: buckets in backprop order --------------------------
# (specification tests too: the timeline's rule computed by hand, see the section above)


def test_wait_free_timeline_hand_computed():
    # backward takes 1 s; 3 buckets ready at 0.2, 0.5, 0.8 s
    # each exchange done before the next bucket is ready, the last by 0.9: all hidden
    assert steps.wait_free_exposed([(0.2, 0.1), (0.5, 0.1), (0.8, 0.1)], 1.0) == 0.0
    # the 2nd waits for the 1st (0.2 + 0.4 = 0.6, then 0.95), the 3rd for the 2nd: ends at 1.05
    assert steps.wait_free_exposed([(0.2, 0.4), (0.5, 0.35), (0.8, 0.1)], 1.0) == pytest.approx(0.05, rel=1e-12)
    # two stages on separate links (a sum inside, then a push): the 2nd bucket's sum runs
    # beside the 1st one's push; pushes end at 0.2+0.1+0.3 = 0.6, 0.9, then 0.9 + 0.3 = 1.2
    assert steps.wait_free_exposed([(0.2, 0.1, 0.3), (0.5, 0.1, 0.3), (0.8, 0.1, 0.3)], 1.0) == pytest.approx(
        0.2, rel=1e-12
    )


# 4 MB of gradients in 3 tensors, in backprop order: half of them ready at a quarter of
# backward, a quarter at half of it, the last quarter (the first layer) at its end
TOY = LayerProfile("toy", tensors=((500_000, 0.25), (250_000, 0.5), (250_000, 1.0)), backward_share=0.6)


def test_wait_free_overlap_in_the_step_hand_computed():
    # 0.5 MiB buckets: one tensor each (2, 1, 1 MB); 8 messages (ceil(4e6 / 2**19)), so the
    # exchange is ALLREDUCE_8 with 7 more latency terms (6e-5 inside, 2e-4 across), split
    # over the buckets by bytes; backward = 0.6 x 0.1 s, buckets ready at 0.015, 0.03, 0.06 s
    workload = Workload(parameters=1_000_000, bytes_per_parameter=4, batch=10, compute_s=0.1, layers=TOY)
    s = specs.model_step("allreduce", workload, MACHINE, 8, knobs("allreduce", bucket_cap_mb=0.5))
    exchange = ALLREDUCE_8 + 7 * (6e-5 + 2e-4)
    first_two = 0.015 + exchange * 0.75  # the 2nd bucket is ready (0.03) before the 1st is done
    assert first_two < 0.06
    assert s.exchange_s == pytest.approx(exchange, rel=1e-9)
    assert s.exposed_s == pytest.approx(exchange * 0.25, rel=1e-9)  # the last bucket, after backward
    assert s.overlap == "wait-free backprop (toy)"
    # one 25 MiB bucket is ready only at backward's end: nothing hides
    assert step_time("allreduce", 8, workload=workload).exposed_s == pytest.approx(ALLREDUCE_8, rel=1e-9)
    # the compressed all-reduces take the same timeline; the parameter servers do not overlap
    half = specs.model_step("allreduce_fp16", workload, MACHINE, 8, knobs("allreduce_fp16", bucket_cap_mb=0.5))
    assert half.exposed_s == pytest.approx(half.exchange_s * 0.25, rel=1e-9)
    assert step_time("ps_sync", 8, workload=workload, shards=2).overlap == "none"
    assert step_time("allreduce", 8).overlap == "fixed 0 of compute"
    # an exchange in two stages (a sum inside, then a push), each bucket its share of both:
    # backward 0.06 s; sums of 0.02, 0.01, 0.01 s and pushes of 0.04, 0.02, 0.02 s from 0.015,
    # 0.03, 0.06 s: pushes end at 0.075 and 0.095; the 3rd's sum ends at 0.07, its push waits
    # for the 2nd's: 0.095 + 0.02 = 0.115 s
    assert steps.overlapped(workload, MACHINE, (0.04, 0.08), 0.5) == pytest.approx(0.115 - 0.06, rel=1e-12)
    assert steps.overlapped(W, MACHINE, (0.04, 0.08), 0.5) == pytest.approx(0.12, rel=1e-12)  # no profile: all


def test_buckets_go_in_backprop_order():
    # the shipped profiles list the output layer first, the input layer last
    layers = [name.rsplit(".", 1)[0] for name, *_ in layer_profiles._shipped()["lenet5"]["tensors"]]
    assert list(dict.fromkeys(layers)) == ["classifier.5", "classifier.3", "classifier.1", "features.3", "features.0"]
    vgg = layer_profiles.load("vgg16", "test")
    ready = [share for _, share in vgg.tensors]
    assert ready == sorted(ready) and ready[-1] == 1.0
    # VGG-16's fully connected layers (89% of its values) are ready within 1% of backward
    early = sum(values for values, share in vgg.tensors if share < 0.01)
    assert early / sum(values for values, _ in vgg.tensors) > 0.89
    # the timeline takes the buckets in that order: the big early bucket hides, and the
    # same bytes in forward order would not
    workload = Workload(parameters=1_000_000, bytes_per_parameter=4, batch=10, compute_s=0.1, layers=TOY)
    cap = knobs("allreduce", bucket_cap_mb=0.5)
    forward = LayerProfile("forward", tuple(zip([v for v, _ in reversed(TOY.tensors)], [0.25, 0.5, 1.0])), 0.6)
    backprop = specs.model_step("allreduce", workload, MACHINE, 8, cap).exposed_s
    reordered = specs.model_step(
        "allreduce", Workload(1_000_000, 4, 10, 0.1, layers=forward), MACHINE, 8, cap
    ).exposed_s
    assert reordered == pytest.approx(backprop * 2, rel=1e-9)  # the last bucket holds 2 MB, not 1


def test_shipped_profile_matches_the_flop_counter():
    measured = layer_profiles.measure("lenet5")
    shipped = layer_profiles._shipped()["lenet5"]
    assert measured["tensors"] == shipped["tensors"]
    assert (measured["forward_flops"], measured["backward_flops"]) == (
        shipped["forward_flops"],
        shipped["backward_flops"],
    )
    assert measured["parameters"] == 61706  # the study's LeNet-5


def test_profile_column_groups_are_the_quantisers():
    # the profile's count of 1-bit column groups is the one the strategy quantises with
    import torch

    from dtstudy.strategies.compressed.onebit_codec import quantization_groups

    for name in ("lenet5", "vgg16"):
        with torch.device("meta"):  # shapes only, as the profiles are measured
            shapes = [p.shape for p in layer_profiles._build(name).parameters()]
        profile = layer_profiles.load(name, "test")
        assert profile.column_groups == len(quantization_groups(shapes, "column"))
        assert len(profile.tensors) == len(quantization_groups(shapes, "tensor"))
    assert layer_profiles.load("lenet5", "test").column_groups == 6 + 16 + 120 + 84 + 10 + 5  # rows + 5 biases


def run_command_without_torch(tmp_path, args):
    """`python -m dtstudy project ...` in a fresh interpreter that must not import torch."""
    script = (
        "import sys; from dtstudy.__main__ import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'the projection imported torch'; sys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": WORKFLOW}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_command_with_a_layer_profile(tmp_path):
    m, h = write_inputs(tmp_path)
    fixed = project.run_command(m, h, "allreduce,ps_sync", "1,8,64", str(tmp_path / "fixed.csv"))
    # a model named like no shipped profile keeps the fixed overlap, and the table says why
    assert (
        "the hardware profile's fixed overlap, 0 of compute: model.layer_profile not given and model.name names "
        "none: no layer profile of 'my_resnet50' is shipped" in (tmp_path / "fixed.md").read_text()
    )
    measured = yaml.safe_load((tmp_path / "M.yaml").read_text())
    measured["model"]["name"] = "resnet50"  # named like a shipped profile: it takes it, and says so
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    (tmp_path / "named").mkdir()
    named = project.run_command(m, h, "allreduce,ps_sync", "1,8,64", str(tmp_path / "named/projection.csv"))
    assert (
        "wait-free backprop on the layer profile 'resnet50' (model.name 'resnet50', a shipped layer profile; "
        "model.layer_profile not given;" in (tmp_path / "named/projection.md").read_text()
    )
    measured["model"]["layer_profile"] = "resnet50"
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    out = tmp_path / "projection.csv"
    run_command_without_torch(tmp_path, project_args(m, h, str(out), workers="1,8,64"))
    with open(out) as handle:
        rows = {(r["strategy"], int(r["workers"])): r for r in csv.DictReader(handle)}
    before = {(r["strategy"], r["workers"]): r for r in fixed}
    assert rows[("allreduce", 64)]["overlap"] == "wait-free backprop (resnet50)"
    assert before[("allreduce", 64)]["overlap"] == "fixed 0 of compute"
    assert rows[("ps_sync", 64)]["overlap"] == "none"
    # both fit intra_node to the same measured N=8 (so both give 378 there by construction:
    # the fit against a hand solution and an N it was not fitted to are checked in
    # test_command_on_a_measurement_file_alone); at N=64 the timeline hides part of the exchange
    assert float(rows[("allreduce", 64)]["step_exchange_s"]) < 0.9 * before[("allreduce", 64)]["step_exchange_s"]
    assert float(rows[("ps_sync", 64)]["throughput"]) == pytest.approx(before[("ps_sync", 64)]["throughput"], rel=1e-5)
    assert (
        "wait-free backprop on the layer profile 'resnet50' (model.layer_profile;"
        in (tmp_path / "projection.md").read_text()
    )
    # the profile the name names is the one the key names
    for name_row, key_row in zip(named, rows.values()):
        assert name_row["throughput"] == pytest.approx(float(key_row["throughput"]), rel=1e-5)
    # a name whose profile is another network (resnet152's parameters are not these): the fixed overlap, saying why
    measured["model"] = {**measured["model"], "name": "resnet152"}
    del measured["model"]["layer_profile"]
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(measured))
    (tmp_path / "other").mkdir()
    other = project.run_command(m, h, "allreduce", "1,64", str(tmp_path / "other/projection.csv"))
    assert other[-1]["overlap"] == "fixed 0 of compute"
    assert "the shipped layer profile does not fit: 'resnet152' has" in (tmp_path / "other/projection.md").read_text()


# ----- stragglers: order statistics -------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_expected_max_of_exponentials_is_mean_times_harmonic_number(k):
    harmonic = sum(1 / i for i in range(1, k + 1))
    assert waits.expected_order_statistic("exponential", 0.01, k, k) == pytest.approx(0.01 * harmonic)
    assert waits.expected_order_statistic("uniform", 0.01, k, k) == pytest.approx(0.02 * k / (k + 1))
    assert waits.expected_order_statistic("fixed", 0.01, k, k) == 0.01


def _simulated(distribution, mean, draws, pick, samples=20000, window=1):
    rng = random.Random(7)

    def draw():
        if distribution == "uniform":
            return rng.uniform(0, 2 * mean)
        return rng.expovariate(1 / mean)

    total = 0.0
    for _ in range(samples):
        values = sorted(sum(draw() for _ in range(window)) / window for _ in range(draws))
        total += pick(values)
    return total / samples


@pytest.mark.parametrize("distribution", ["exponential", "uniform"])
def test_order_statistics_match_simulation(distribution):
    # the (N-k)-th of 6 slow workers (ps_backup k=2) and the slowest mean over windows of 4 steps
    assert waits.expected_order_statistic(distribution, 1.0, 4, 6) == pytest.approx(
        _simulated(distribution, 1.0, 6, lambda v: v[3]), rel=0.03
    )
    assert waits.expected_max_of_window_means(distribution, 1.0, 6, 4) == pytest.approx(
        _simulated(distribution, 1.0, 6, lambda v: v[-1], samples=8000, window=4), rel=0.03
    )


def _max_of_erlang_means(k: int, window: int) -> Fraction:
    """E[max of k iid means of `window` exponential draws of mean 1], exactly: each mean is
    Gamma(window, 1/window), whose survival in y = window x is S(y) = e^-y sum_{i<window} y^i/i!;
    E[max] = (1/window) integral of 1 - (1 - S)^k = (1/window) sum_j (-1)^(j+1) C(k, j) integral S^j,
    and integral e^(-j y) y^m dy = m! / j^(m+1) term by term of the polynomial's j-th power."""
    base = [Fraction(1, math.factorial(i)) for i in range(window)]
    total = Fraction(0)
    for j in range(1, k + 1):
        power = [Fraction(1)]
        for _ in range(j):
            product = [Fraction(0)] * (len(power) + window - 1)
            for a, x in enumerate(power):
                for b, y in enumerate(base):
                    product[a + b] += x * y
            power = product
        integral = sum(c * Fraction(math.factorial(m), j ** (m + 1)) for m, c in enumerate(power))
        total += (-1) ** (j + 1) * math.comb(k, j) * integral
    return total / window


def test_stragglers_in_the_step(monkeypatch):
    slow = Stragglers(delay_s=0.05, distribution="exponential", fraction=0.5)  # 4 of 8 workers
    h4 = 1 + 1 / 2 + 1 / 3 + 1 / 4
    base = step_time("ps_sync", 8, shards=2).step_s
    assert step_time("ps_sync", 8, stragglers=slow, shards=2).step_s == pytest.approx(base + 0.05 * h4)
    # backup k=2: the 6th arrival of 8 = the 2nd of the 4 slow ones: 0.05 (1/4 + 1/3)
    assert step_time("ps_backup", 8, stragglers=slow, shards=2, backup=2).straggler_s == pytest.approx(
        0.05 * (1 / 4 + 1 / 3)
    )
    # backup k=4: the 4 fast ones make the update
    assert step_time("ps_backup", 8, stragglers=slow, shards=2, backup=4).straggler_s == 0
    # as a share of N: round(0.25 * 8) = 2 backups, the same wait as backup=2
    assert step_time("ps_backup", 8, stragglers=slow, shards=2, backup_fraction=0.25).straggler_s == pytest.approx(
        0.05 * (1 / 4 + 1 / 3)
    )
    # asynchronous: 4 workers at 0.1802 s, 4 at 0.2302 s, nobody waits for anybody
    rate = 4 / 0.1802 + 4 / 0.2302
    assert step_time("ps_async", 8, stragglers=slow, shards=2).throughput == pytest.approx(10 * rate, rel=1e-9)
    # SSP with s = 2 (the default) may run 2 steps ahead: it waits for the slowest of the 4
    # slow workers' delays averaged over windows of s + 1 = 3 steps, 0.05 x E[max of 4 means
    # of 3 unit exponentials] = 0.05 x 38948987/23887872 = 0.0815246 s (ps_sync, windows of
    # 1: 0.05 x 25/12 = 0.1042 s)
    assert knobs("ssp")["staleness"] == 2
    assert _max_of_erlang_means(4, 1) == Fraction(25, 12) and _max_of_erlang_means(4, 3) == Fraction(38948987, 23887872)

    def ssp_wait():
        return step_time("ssp", 8, stragglers=slow, shards=2).straggler_s

    expected = 0.05 * float(_max_of_erlang_means(4, 3))
    assert ssp_wait() == pytest.approx(expected, rel=1e-6)
    # control: windows of s steps instead of s + 1 (0.0886791 s) must fail the same check
    monkeypatch.setattr(
        specs.SspSpec,
        "step_model",
        classmethod(
            lambda cls, workload, machine, workers, params, stragglers: steps.ps_async_step(
                cls.name, workload, machine, workers, params, stragglers, window=params["staleness"]
            )
        ),
    )
    assert ssp_wait() == pytest.approx(0.05 * float(_max_of_erlang_means(4, 2)), rel=1e-6)
    assert ssp_wait() != pytest.approx(expected, rel=1e-6)


# ----- calibration -----------------------------------------------------------------------


def test_fit_recovers_alpha_and_beta():
    alpha, bandwidth = 3e-5, 2.5e9
    sizes = [2**k for k in range(10, 23)]
    rng = random.Random(1)
    p2p = [[m, (alpha + m / bandwidth) * (1 + rng.uniform(-0.01, 0.01))] for m in sizes]
    fit = calibration.fit_p2p(p2p)
    assert fit["latency_s"] == pytest.approx(alpha, rel=0.15)
    assert fit["bandwidth"] == pytest.approx(bandwidth, rel=0.02)
    # ring all-reduce over 4 processes: 6 alpha + 1.5 m / B, exact
    ring = [[m, collectives.ring_allreduce_time(m, 4, Link(alpha, bandwidth))] for m in sizes]
    fit = calibration.fit_allreduce(ring, 4)
    assert fit["latency_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["bandwidth"] == pytest.approx(bandwidth, rel=1e-6)


# ----- bad inputs, and the command on a measurement file alone --------------------------------


def write_inputs(tmp_path, measured=None, hardware_profile=None):
    # a name of no shipped layer profile: the hardware profile's fixed overlap, as hand-solved
    m = measured or {
        "model": {"name": "my_resnet50", "parameters": 25557032, "bytes_per_parameter": 4},
        "per_worker_batch": 64,
        "throughput": {1: 52.4, 8: 378},
    }
    h = hardware_profile or {
        "gpus_per_node": 8,
        "inter_node": {"bandwidth_gbit_s": 10, "latency_us": 50},
        "strategy_params": {"ps_sync": {"shards": 8, "placement": "colocated"}},
    }
    (tmp_path / "M.yaml").write_text(yaml.safe_dump(m))
    (tmp_path / "H.yaml").write_text(yaml.safe_dump(h))
    return str(tmp_path / "M.yaml"), str(tmp_path / "H.yaml")


def run_main(argv):
    from dtstudy.__main__ import main

    return main(argv)


def project_args(m, h, out, strategies="allreduce,ps_sync", workers="1,8,16"):
    return [
        "project",
        "measured",
        "--measured",
        m,
        "--hardware",
        h,
        "--strategies",
        strategies,
        "--workers",
        workers,
        "--out",
        out,
    ]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_n1", ["throughput", "N=1", "[8]"]),
        ("unknown_strategy", ["--strategies", "'allreduse'", "allowed:", "ps_sync"]),
        ("negative_bandwidth", ["inter_node.bandwidth_gbit_s", "-10", "allowed: a number > 0"]),
        ("missing_key", ["per_worker_batch", "missing"]),
        ("bad_placement", ["strategy_params.ps_sync.placement", "'everywhere'", "['colocated', 'dedicated']"]),
        ("bad_period", ["strategy_params.local_sgd.period", "0", "an integer >= 1"]),
        ("knob_of_wrong_type", ["strategy_params.allreduce.bucket_cap_mb", "'25'", "is not a number"]),
        ("unknown_knob", ["strategy_params.ps_sync.shard", "unknown knob", "shards", "placement"]),
        ("bad_stragglers", ["stragglers.distribution", "'gamma'", "'fixed', 'uniform', 'exponential'"]),
        ("bad_ps_request", ["ps_request_us", "-5", "a number >= 0"]),
        ("ps_request_measured", ["ps_request_us", "'measured'", "N=1 parameter-server runs"]),
        ("unknown_layer_profile", ["model.layer_profile", "'resnet5'", "allowed:", "resnet152, resnet50, vgg16"]),
        ("other_network_profile", ["model.layer_profile", "'vgg16'", "138357544", "model.parameters", "1000"]),
    ],
)
def test_bad_inputs_name_the_key(tmp_path, capsys, case, expected):
    measured = {
        "model": {"name": "x", "parameters": 1000, "bytes_per_parameter": 4},
        "per_worker_batch": 8,
        "throughput": {1: 10.0, 8: 70.0},
    }
    profile = {"gpus_per_node": 8, "inter_node": {"bandwidth_gbit_s": 10, "latency_us": 50}}
    strategies = "allreduce,ps_sync"
    if case == "no_n1":
        measured["throughput"] = {8: 70.0}
    elif case == "unknown_strategy":
        strategies = "allreduse"
    elif case == "negative_bandwidth":
        profile["inter_node"]["bandwidth_gbit_s"] = -10
    elif case == "missing_key":
        del measured["per_worker_batch"]
    elif case == "bad_placement":
        profile["strategy_params"] = {"ps_sync": {"placement": "everywhere"}}
    elif case == "bad_period":
        profile["strategy_params"] = {"local_sgd": {"period": 0}}
        strategies = "local_sgd"
    elif case == "knob_of_wrong_type":  # the strategy's own schema checks a profile's knobs
        profile["strategy_params"] = {"allreduce": {"bucket_cap_mb": "25"}}
    elif case == "unknown_knob":
        profile["strategy_params"] = {"ps_sync": {"shard": 4}}
    elif case == "bad_stragglers":
        profile["stragglers"] = {"fraction": 0.1, "delay_ms": 20, "distribution": "gamma"}
    elif case == "bad_ps_request":
        profile["ps_request_us"] = -5
    elif case == "ps_request_measured":  # the command has no study runs to measure it on
        profile["ps_request_us"] = "measured"
    elif case == "unknown_layer_profile":
        measured["model"]["layer_profile"] = "resnet5"
    elif case == "other_network_profile":  # a profile of another network than model.parameters counts
        measured["model"]["layer_profile"] = "vgg16"
    m, h = write_inputs(tmp_path, measured, profile)
    out = tmp_path / "p.csv"
    assert run_main(project_args(m, h, str(out), strategies)) == 2
    message = capsys.readouterr().err
    for part in expected:
        assert part in message
    assert not out.exists()  # stopped before any work


def test_command_projects_the_hardware_files_stragglers(tmp_path):
    """Slow workers on the cluster (H.yaml `stragglers`, the study config's keys): a
    synchronous step waits for the slowest of them; ps_backup with more backups than slow
    workers for none of them, as backup workers were meant to do (Chen et al. 2016)."""
    profile = {
        "gpus_per_node": 8,
        "inter_node": {"bandwidth_gbit_s": 100, "latency_us": 5},
        "strategy_params": {"ps_sync": {"shards": 32}, "ps_backup": {"shards": 32, "backup": 16}},
    }

    def steps(stragglers):
        folder = tmp_path / str(len(stragglers))
        folder.mkdir()
        m, h = write_inputs(folder, hardware_profile={**profile, **stragglers})
        rows = project.run_command(m, h, "ps_sync,ps_backup", "1,256", str(folder / "p.csv"))
        return {(r["strategy"], r["workers"]): r for r in rows}, (folder / "p.md").read_text()

    plain, _ = steps({})
    slow, md = steps({"stragglers": {"fraction": 0.05, "delay_ms": 50, "distribution": "exponential"}})
    # 256 x 0.05 = 13 slow workers: ps_sync waits for the largest of 13 exponential delays
    # of mean 50 ms, 0.05 x H_13; ps_backup needs 240 of 256 pushes, all from fast workers
    harmonic_13 = sum(1 / i for i in range(1, 14))
    assert slow[("ps_sync", 256)]["step_s"] - plain[("ps_sync", 256)]["step_s"] == pytest.approx(0.05 * harmonic_13)
    assert slow[("ps_sync", 256)]["straggler_s"] == pytest.approx(0.05 * harmonic_13)
    assert slow[("ps_backup", 256)]["step_s"] == pytest.approx(plain[("ps_backup", 256)]["step_s"])
    assert slow[("ps_backup", 256)]["throughput"] > slow[("ps_sync", 256)]["throughput"]
    assert slow[("ps_sync", 1)]["step_s"] == pytest.approx(plain[("ps_sync", 1)]["step_s"])  # round(0.05) = 0 slow
    assert "stragglers: profile: {'delay_ms': 50, 'distribution': 'exponential', 'fraction': 0.05}" in md


def _fit_and_unfitted_n_misses(rows: list[dict], md: str) -> list[str]:
    """What is off in a `project` command's output on write_inputs' files (ResNet-50, a
    gradient of M = 4 x 25557032 = 102228128 bytes, N=1 at 52.4 and N=8 at 378 images/s; 8 GPUs a node,
    10 Gbit/s and 50 us between nodes; no intra_node, overlap 0): the intra-node link fitted
    to N=8 against its hand solution, and N=16 (2 nodes: not fitted) against its hand
    prediction. At N=8 (one node, 4 buckets of 25 MiB, the fit's latency 0) the exchange is
    the ring's 2 (8-1)/8 M / B, and it must fill the measured step 512/378 s beyond
    t_c = 64/52.4 s: B = 1.75 M / (512/378 - 64/52.4). At N=16 the same ring inside
    (the same seconds), then a ring over the 2 nodes: 2 x 1 x 4 x 50 us + 2 (1/2) M / 1.25e9."""
    model_bytes = 25557032 * 4
    t_c, step_8 = 64 / 52.4, 512 / 378
    bandwidth = 1.75 * model_bytes / (step_8 - t_c)  # 1.344 GB/s
    step_16 = t_c + 1.75 * model_bytes / bandwidth + 2 * 4 * 50e-6 + model_bytes / 1.25e9
    misses = []
    fitted = f"fitted: {bandwidth / 1e9:.4g} GB/s per GPU makes allreduce at N=8"
    if fitted not in md:
        found = re.search(r"fitted: [^\n]*", md)
        misses.append(f"no {fitted!r} but {found.group(0) if found else 'no fit'!r}")
    allreduce = {int(r["workers"]): r for r in rows if r["strategy"] == "allreduce"}
    projected = float(allreduce[16]["throughput"])
    if projected != pytest.approx(1024 / step_16, rel=1e-5):
        misses.append(f"N=16: {projected} images/s, by hand {1024 / step_16:.6g}")
    return misses


def test_command_on_a_measurement_file_alone(tmp_path, monkeypatch):
    m, h = write_inputs(tmp_path)
    out = tmp_path / "projection.csv"
    run_command_without_torch(tmp_path, project_args(m, h, str(out), workers="1,8,16,32,64"))
    with open(out) as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[:9] == [
        "strategy",
        "workers",
        "throughput",
        "efficiency",
        "speedup",
        "step_compute_s",
        "step_exchange_s",
        "bound",
        "profile",
    ]
    assert [(r["strategy"], int(r["workers"])) for r in rows] == [
        (s, n) for s in ("allreduce", "ps_sync") for n in (1, 8, 16, 32, 64)
    ]
    allreduce = {int(r["workers"]): r for r in rows if r["strategy"] == "allreduce"}
    assert float(allreduce[1]["throughput"]) == pytest.approx(52.4)  # the measured N=1
    # intra_node is fitted to N=8: its throughput there is 378 by construction. Checked instead:
    # the fitted link against its hand solution and N=16, which was not fitted, by hand
    assert _fit_and_unfitted_n_misses(rows, (tmp_path / "projection.md").read_text()) == []

    # control: a ring all-reduce that moves (p-1)/p of the bytes instead of 2 (p-1)/p (a
    # reduce-scatter without its all-gather). The fit absorbs it at N=8 (still 378 there), so
    # the old check passed; the hand solution does not (half the bandwidth), nor does N=16
    # (half the inter-node ring's bytes, about 3% faster)
    def reduce_scatter_only(nbytes, participants, link, messages=1):
        p = participants
        return 0.0 if p <= 1 else 2 * (p - 1) * messages * link.latency_s + (p - 1) / p * nbytes / link.bandwidth

    monkeypatch.setattr(collectives, "ring_allreduce_time", reduce_scatter_only)
    (tmp_path / "control").mkdir()
    planted = project.run_command(m, h, "allreduce", "1,8,16", str(tmp_path / "control/projection.csv"))
    assert next(r for r in planted if r["workers"] == 8)["throughput"] == pytest.approx(378, rel=1e-6)
    planted_rows = [{**r, "workers": str(r["workers"])} for r in planted]
    misses = _fit_and_unfitted_n_misses(planted_rows, (tmp_path / "control/projection.md").read_text())
    assert len(misses) == 2, misses
    efficiency = [float(allreduce[n]["efficiency"]) for n in (8, 16, 32, 64)]
    assert efficiency == sorted(efficiency, reverse=True) and efficiency[-1] < efficiency[0]
    # N=16, 8 shards on 2 nodes: each NIC takes 8 remote workers' halves of the model (4 M) in
    # and sends as much out, per phase: one latency of 50 us (the 16 messages at once) + 4 M at
    # 1.25 GB/s; push and pull
    ps16 = next(r for r in rows if r["strategy"] == "ps_sync" and r["workers"] == "16")
    assert float(ps16["step_exchange_s"]) == pytest.approx(2 * (50e-6 + 4 * 25557032 * 4 / 1.25e9), rel=1e-4)
    assert "fitted" in (tmp_path / "projection.md").read_text()


def test_profiles_load_and_say_where_values_came_from():
    for name in ("minotauro_k80", "h100_ib400"):
        profile = hardware.load_profile(name)
        machine, source, needs_fit = hardware.machine_from_profile(profile)
        assert not needs_fit and machine.gpus_per_node in (4, 8) and source["inter_node"].startswith("profile: ")
    assert source["inter_node"] == "profile: 3200 Gbit/s x payload_fraction 0.96 = 384 GB/s, 5 us"  # h100_ib400
    profile = hardware.load_profile("this_machine")
    with pytest.raises(ConfigError, match="intra_node"):
        hardware.machine_from_profile(profile)  # 'measured' needs the benchmark
    with pytest.raises(ConfigError, match="projection.hardware"):
        hardware.load_profile("no_such_profile")


def test_payload_fraction_is_the_share_of_a_line_rate_the_bytes_get():
    """A profile may state a link's line rate with the share of it that carries the
    exchange's bytes (framing, encoding, the transport's losses): the link is that rate x
    the share, so a ring across 4 nodes of 1 GPU at half of 10 Gbit/s takes twice the
    bandwidth term: 6 x 50 us + 1.5 x 4e6 B / 0.625e9 B/s."""

    def machine(inter):
        return hardware.machine_from_profile(
            {"name": "p", "gpus_per_node": 1, "inter_node": inter, "intra_node": {"bandwidth_gbyte_s": 10}}
        )[0]

    half = machine({"bandwidth_gbit_s": 10, "latency_us": 50, "payload_fraction": 0.5})
    assert half.inter.bandwidth == pytest.approx(0.625e9)
    assert collectives.allreduce_time(4e6, 4, half) == pytest.approx(6 * 50e-6 + 1.5 * 4e6 / 0.625e9, rel=1e-12)
    assert machine({"bandwidth_gbit_s": 10, "latency_us": 50}).inter.bandwidth == pytest.approx(1.25e9)  # default 1
    for value in (0, 1.5, "0.9", True):
        with pytest.raises(
            ConfigError,
            match=rf"key 'inter_node\.payload_fraction': {re.escape(repr(value))} is "
            rf"[^;]*; allowed: a number in \(0, 1\]$",
        ):
            machine({"bandwidth_gbit_s": 10, "payload_fraction": value})
    with pytest.raises(
        ConfigError,
        match=r"key 'inter_node\.payload_fracton': unknown key 'payload_fracton'; allowed: "
        r"bandwidth_gbit_s, latency_us, payload_fraction$",
    ):
        machine({"bandwidth_gbit_s": 10, "payload_fracton": 0.9})  # a misspelt key is not ignored


def test_natural_jitter_and_shared_cores():
    # E[max of 2 standard normals] = 1/sqrt(pi); of 3: 3/(2 sqrt(pi))
    assert waits.expected_normal_order_statistic(2, 2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert waits.expected_normal_order_statistic(3, 3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-4)
    # a measured skew of 10% of the step at N=2 costs exactly that at N=2, more at N=3,
    # nothing to the asynchronous workers; 2 busy workers at half a core each: compute x 2
    machine = Machine(4, MACHINE.intra, MACHINE.inter, skew_fraction=0.1, compute_scale={2: 2.0})
    base = step_time("allreduce", 2)
    jittery = step_time("allreduce", 2, machine=machine)
    assert jittery.step_s == pytest.approx(2 * 0.1 + (base.step_s - 0.1) + 0.1 * 0.2, rel=1e-4)
    assert step_time("allreduce", 3, machine=machine).straggler_s == pytest.approx(0.1 * 0.1 * 1.5, rel=1e-4)
    assert step_time("ps_async", 2, machine=machine).straggler_s == pytest.approx(0, abs=1e-12)


def fake_run(folder, strategy, workers, throughput, comm_s, bytes_per_step, strategy_params=None):
    import json

    folder.mkdir(parents=True)
    step = 64 * workers / throughput
    metrics = {
        "strategy": strategy,
        "workers": workers,
        "seed": 0,
        "throughput": throughput,
        "step_time": {"total_s": step, "compute_s": step - comm_s, "comm_s": comm_s, "data_s": 0.0},
        "bytes_per_step": bytes_per_step,
        "per_worker_batch": 64,
        "environment": {"oversubscribed": False},
        "strategy_params": strategy_params or {},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return str(folder / "metrics.json")


def recorded_runs(tmp_path) -> list[str]:
    """What the project rule reads: allreduce's metrics.json at N = 1, 2 and gossip's at N = 2
    (LeNet-5's 61706 parameters), and this machine's benchmark in tmp_path/bench.json."""
    import json

    ring = 2 * (2 - 1) / 2 * 61706 * 4
    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "a2", "allreduce", 2, 14000.0, 0.0005, ring),
        fake_run(tmp_path / "g2", "gossip", 2, 13000.0, 0.0008, 61706 * 4),
    ]
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"allreduce_fp16": 1e-10, "server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.05},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    return metrics


def test_project_rule_on_recorded_runs(tmp_path):
    metrics = recorded_runs(tmp_path)
    config = {
        "model": "lenet5",
        "strategies": ["allreduce", "gossip"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2, 64, 1024], "hardware": "this_machine"},
    }
    out = tmp_path / "tables/projection.csv"
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(out),
        str(tmp_path / "tables/projection.md"),
        str(tmp_path / "plots/projection.png"),
    )
    assert (tmp_path / "plots/projection.png").stat().st_size > 10_000
    with open(out) as handle:
        written = list(csv.DictReader(handle))
    assert [(r["strategy"], int(r["workers"])) for r in written] == [
        (s, n) for s in ("allreduce", "gossip") for n in (1, 2, 64, 1024)
    ]
    first = {(r["strategy"], r["workers"]): r for r in rows}
    # compute = the N=1 step 64/8000 s; allreduce at N=2: + the fitted all-reduce of the
    # 246824-byte gradient over 2 processes (2 x 1e-4 + 246824/2e9) + 5% jitter
    t_c = 64 / 8000
    expected = t_c + 2e-4 + 246824 / 2e9 + 0.05 * t_c
    assert first[("allreduce", 2)]["throughput"] == pytest.approx(128 / expected, rel=1e-3)
    assert first[("allreduce", 2)]["measured_throughput"] == 14000.0
    assert first[("gossip", 2)]["measured_exchange_s"] == 0.0008
    assert first[("allreduce", 1024)]["bound"] in {"network", "straggler"}
    assert "measured (gloo" in (tmp_path / "tables/projection.md").read_text()
    # the study's LeNet-5 has a shipped profile: the wait-free timeline (its one bucket is
    # ready at backward's end, so all of the exchange shows, as computed above)
    assert first[("allreduce", 2)]["overlap"] == "wait-free backprop (lenet5)"
    assert "'lenet5' (config key 'model'" in (tmp_path / "tables/projection.md").read_text()
    # a model without a profile keeps the hardware profile's fixed overlap, and says why
    other = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        {**config, "model": "resnet18"},
        str(out),
        str(tmp_path / "tables/projection.md"),
        str(tmp_path / "plots/projection.png"),
    )
    assert {r["overlap"] for r in other if r["strategy"] == "allreduce"} == {"fixed 0 of compute"}
    assert "no layer profile of 'resnet18'" in (tmp_path / "tables/projection.md").read_text()
    # a shipped name on another network (LeNet-5 on 3-channel 32x32 images: more parameters)
    assert calibration.study_layers("lenet5", 83126)[0] is None
    assert "83126" in calibration.study_layers("lenet5", 83126)[1]
    # without an N=1 run: the per-worker compute (exchange excluded) at the smallest N, both runs
    workload, source = calibration.workload_from_runs(calibration.read_runs(metrics[1:]), 61706)
    assert workload.compute_s == pytest.approx(((128 / 14000 - 0.0005) + (128 / 13000 - 0.0008)) / 2)
    assert "N=2" in source["compute_s"]


def test_project_rule_on_a_study_of_n1_only_takes_powersgd_bytes_from_the_model(tmp_path):
    """At N=1 PowerSGD exchanges nothing, so no run measures its bytes: the rule reads the
    model's matrices from model.pt (LeNet-5, rank 2, hand-computed) instead of failing."""
    import json

    import torch

    from dtstudy.training.models import build_model

    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "p1", "allreduce_powersgd", 1, 7900.0, 0.0, 0.0),
    ]
    torch.save({"state_dict": build_model("lenet5", 1, 10, 28, {}).state_dict()}, tmp_path / "a1" / "model.pt")
    assert calibration.matrices_from_checkpoint(tmp_path / "a1" / "model.pt") == [
        [6, 25],
        [6, 1],
        [16, 150],
        [16, 1],
        [120, 400],
        [120, 1],
        [84, 120],
        [84, 1],
        [10, 84],
        [10, 1],
    ]
    # sent: (6+25)2 + (16+150)2 + (120+400)2 + (84+120)2 + (10+84)2 and the 236 bias values whole
    ratio = (62 + 332 + 1040 + 408 + 188 + 236) / 61706
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"allreduce_fp16": 1e-10, "allreduce_powersgd": 2e-9, "server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.0},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["allreduce", "allreduce_powersgd"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2], "hardware": "this_machine"},
    }
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(tmp_path / "p.csv"),
        str(tmp_path / "p.md"),
        str(tmp_path / "p.png"),
    )
    exchange = {r["strategy"]: r["step_exchange_s"] for r in rows if r["workers"] == 2}
    # three all-reduces (the whole tensors, P, Q) of the ratio's bytes on 2 processes: 3 x (2 x 1e-4) + bytes / 2e9,
    # and the benchmark's PowerSGD kernel (compression's own work) over the gradient's bytes
    assert exchange["allreduce_powersgd"] == pytest.approx(6e-4 + ratio * 61706 * 4 / 2e9 + 2e-9 * 61706 * 4, rel=1e-6)
    provenance = re.search(r"- matrices: (.*)", (tmp_path / "p.md").read_text()).group(1)
    assert provenance.startswith("the model's matrices in a run's model.pt, for allreduce_powersgd at its knobs {")
    assert "'rank': 2," in provenance
    assert "61706 (counted in a run's model.pt)" in (tmp_path / "p.md").read_text()  # no run sent bytes


def test_project_rule_calibrates_the_parameter_servers_round_trip_on_their_n1_runs(tmp_path):
    """this_machine's `ps_request_us: measured`: the N=1 parameter-server runs' exchange beyond
    what the links and the shard's update give it, charged once per round trip at N=2."""
    import json

    m = 61706 * 4
    one_way = 5e-5 + m / 2e9  # the p2p fit below, one gradient's bytes
    update = (1 + 4) * m * 5e-11  # the shard's passes (1 gradient summed, 4 of SGD) at the server kernel
    modelled = 2 * one_way + update
    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "s1", "ps_sync", 1, 7000.0, modelled + 0.0012, m + PS_REQUEST_BYTES, {"shards": 1}),
        fake_run(tmp_path / "y1", "ps_async", 1, 7100.0, modelled + 0.0008, m + PS_REQUEST_BYTES, {"shards": 1}),
        fake_run(tmp_path / "s2", "ps_sync", 2, 12000.0, 0.002, m + PS_REQUEST_BYTES, {"shards": 1}),
    ]
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.0},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["ps_sync", "ps_async"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2], "hardware": "this_machine"},
    }
    md = tmp_path / "tables/projection.md"
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(tmp_path / "tables/p.csv"),
        str(md),
        str(tmp_path / "plots/projection.png"),
    )
    request = 0.001  # the mean of the two runs' 1.2 and 0.8 ms beyond the model
    t_c = 64 / 8000
    # N=2, one shard: each phase takes 2 gradients through the shard's link, one latency (both at once)
    phase = 5e-5 + 2 * m / 2e9
    # the shard's sums: the first push's arrives m/2e9 before the second's, which is longer than a
    # sum (m x 5e-11): only the last sum and the 4 passes of the update are left
    expected = t_c + 2 * phase + request + (1 + 4) * m * 5e-11
    by = {(r["strategy"], r["workers"]): r for r in rows}
    assert by[("ps_sync", 2)]["throughput"] == pytest.approx(128 / expected, rel=1e-9)
    assert by[("ps_async", 1)]["throughput"] == pytest.approx(64 / (t_c + modelled + request), rel=1e-9)
    assert "N=1 parameter-server run(s)" in md.read_text()
    # the model's size from a parameter server's bytes: the gradient after its request header
    from dtstudy.strategies.parameter_server.protocol import REQUEST_SIZE

    assert PS_REQUEST_BYTES == REQUEST_SIZE * 8  # float64 fields
    assert calibration.parameters_from_runs(calibration.read_runs(metrics[1:])) == 61706
    # without N=1 parameter-server runs nothing is charged
    workload = Workload(61706, 4, 64, t_c)
    assert calibration.ps_request_from_runs(calibration.read_runs(metrics[:1]), workload, MACHINE, {})[0] == 0.0


def test_the_model_size_is_read_only_from_runs_whose_bytes_say_it():
    """The calibration asks each run's spec what its bytes a step say of the model's size: a
    plain all-reduce's, fp16's half bytes and easgd's at period 1 give it; easgd's default
    period 8 spreads an exchange over 8 steps and PowerSGD's bytes depend on the shapes, so
    they say nothing and a later run is read."""
    parameters = 61706

    def run(strategy, workers, bytes_per_step, params=None):
        return {
            "strategy": strategy,
            "workers": workers,
            "bytes_per_step": bytes_per_step,
            "strategy_params": params or {},
        }

    def ring(workers, value_bytes):
        return 2 * (workers - 1) / workers * parameters * value_bytes

    read = calibration.parameters_from_runs
    # the first easgd run, period 8: an eighth of a ring a step (it was read as P/8)
    assert read([run("easgd", 4, ring(4, 4) / 8), run("allreduce", 2, ring(2, 4))]) == parameters
    assert read([run("easgd", 4, ring(4, 4), {"period": 1})]) == parameters
    assert read([run("allreduce_bf16", 4, ring(4, 2))]) == parameters
    assert (
        read(
            [
                run("allreduce", 1, 0.0),
                run("allreduce_powersgd", 4, 0.1 * ring(4, 4)),
                run("local_sgd", 4, ring(4, 8) / 8),
                run("gossip", 4, 2 * parameters * 4),
            ]
        )
        is None
    )


def test_a_strategy_whose_bytes_depend_on_shapes_is_calibrated_from_its_own_runs(monkeypatch):
    """needs_matrices, not a name, says which strategies' runs at N > 1 give their byte share."""
    parameters = 61706
    ring = 2 * (4 - 1) / 4 * parameters * 4
    runs = [
        {
            "strategy": strategy,
            "workers": n,
            "seed": 0,
            "throughput": 1000.0,
            "compute_s": 0.05,
            "comm_s": comm,
            "data_s": 0.0,
            "total_s": 0.06,
            "bytes_per_step": sent,
            "per_worker_batch": 64,
            "strategy_params": {},
        }
        for strategy, n, comm, sent in (
            ("allreduce", 1, 0.0, 0.0),
            ("allreduce_powersgd", 1, 0.0, 0.0),
            ("allreduce_powersgd", 4, 0.01, 0.05 * ring),
            ("allreduce_fp16", 4, 0.01, 0.5 * ring),
        )
    ]
    workload, source = calibration.workload_from_runs(runs, parameters)
    assert workload.measured_share == {"allreduce_powersgd": pytest.approx(0.05)}
    assert "measured bytes_per_step: 0.05 of allreduce's" in source["allreduce_powersgd bytes"]
    monkeypatch.setattr(specs.AllReduceFP16Spec, "needs_matrices", True)
    assert calibration.workload_from_runs(runs, parameters)[0].measured_share == {
        "allreduce_powersgd": pytest.approx(0.05),
        "allreduce_fp16": pytest.approx(0.5),
    }


def test_project_rule_projects_every_profile_of_the_list(tmp_path):
    """projection.hardware as a list: one table with a section per profile (the `profile`
    column), one panel row per profile in the plot, provenance for each. The runs' measured
    throughput stands beside the profile of the machine they ran on, up to its cores: not
    beside another machine's, nor at an N that ran oversubscribed here."""
    import json

    ring = 2 * (2 - 1) / 2 * 61706 * 4
    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "a2", "allreduce", 2, 14000.0, 0.0005, ring),
        fake_run(tmp_path / "a16", "allreduce", 16, 9000.0, 0.01, 2 * 15 / 16 * 61706 * 4),
    ]
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.05},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["allreduce"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2, 16], "hardware": ["this_machine", "h100_ib400"]},
    }
    out, md, png = tmp_path / "p.csv", tmp_path / "p.md", tmp_path / "p.png"
    rows = project.run_study(metrics, str(tmp_path / "bench.json"), config, str(out), str(md), str(png))
    with open(out) as handle:
        written = [(r["profile"], int(r["workers"])) for r in csv.DictReader(handle)]
    assert written == [(p, n) for p in ("this_machine", "h100_ib400") for n in (1, 2, 16)]
    by = {(r["profile"], r["workers"]): r for r in rows}
    t_c = 64 / 8000
    # this machine: the benchmark's fit and its 5% jitter; H100: NVLink's 3 us and 450 GB/s at the
    # profile's payload_fraction 0.824 (NCCL's 20.6 of 25 GB/s a link), no jitter
    assert by[("this_machine", 2)]["throughput"] == pytest.approx(
        128 / (t_c + 2e-4 + 246824 / 2e9 + 0.05 * t_c), rel=1e-3
    )
    assert by[("h100_ib400", 2)]["throughput"] == pytest.approx(128 / (t_c + 6e-6 + 246824 / (0.824 * 450e9)), rel=1e-9)
    assert [by[("this_machine", n)]["measured_throughput"] for n in (1, 2, 16)] == [8000.0, 14000.0, ""]
    assert {by[("h100_ib400", n)]["measured_throughput"] for n in (1, 2, 16)} == {""}
    assert {by[("h100_ib400", n)]["measured_exchange_s"] for n in (1, 2, 16)} == {""}
    text = md.read_text()
    assert "none: this profile is another machine than the one the runs ran on" in text
    assert "## Profile: this_machine" in text and "## Profile: h100_ib400" in text
    assert "Where each parameter of h100_ib400 came from" in text and "measured (gloo" in text
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 2 * 4.8 * 100  # two rows of panels at 110 dpi


# ----- the band: the model at the ends of its measured inputs' intervals -----------------------


def test_line_intervals_hand_computed():
    """t intervals of a least-squares line's intercept and slope from the textbook formulas:
    s^2 = SSR / (k - 2), SE(slope) = s / sqrt(Sxx), SE(intercept) = s sqrt(1/k + mean(x)^2 / Sxx)."""
    from scipy import stats

    points = [[0.0, 1.0], [1.0, 3.1], [2.0, 4.9], [3.0, 7.0]]
    k, mx = 4, 1.5
    sxx = sum((x - mx) ** 2 for x, _ in points)  # 5
    intercept, slope = calibration.least_squares_line(points)
    assert (intercept, slope) == pytest.approx((1.03, 1.98))
    ssr = sum((y - intercept - slope * x) ** 2 for x, y in points)
    s = math.sqrt(ssr / (k - 2))
    t = stats.t.ppf(0.975, k - 2)  # 4.303
    (a_low, a_high), (b_low, b_high) = calibration.line_intervals(points)
    assert (b_low, b_high) == pytest.approx((slope - t * s / math.sqrt(sxx), slope + t * s / math.sqrt(sxx)))
    half = t * s * math.sqrt(1 / k + mx**2 / sxx)
    assert (a_low, a_high) == pytest.approx((intercept - half, intercept + half))
    # points on a line leave no spread; two points leave nothing to estimate it from
    exact = calibration.line_intervals([[x, 2 + 3 * x] for x in range(5)])
    assert exact[0] == pytest.approx((2, 2)) and exact[1] == pytest.approx((3, 3))
    assert calibration.line_intervals(points[:2]) is None


def band_bench(alpha=1e-4, bandwidth=2e9, wobble=(0.0, 0.0, 0.0, 0.0)):
    """A benchmark whose all-reduce and send/recv points lie off their lines by `wobble`
    (seconds, one per size), so that their fits have an interval."""
    sizes = [1024, 65536, 1048576, 3145728]
    ring = [[m, 2 * alpha + m / bandwidth + w] for m, w in zip(sizes, wobble)]  # 2 processes: 2 (p-1) = 2
    p2p = [[m, alpha / 2 + m / bandwidth + w] for m, w in zip(sizes, wobble)]
    return {
        "processes": 2,
        "allreduce": ring,
        "p2p": p2p,
        "fit": {"allreduce": calibration.fit_allreduce(ring, 2), "p2p": calibration.fit_p2p(p2p)},
        "kernels_s_per_byte": {"server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.05},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }


def test_band_is_the_model_at_the_ends_of_t_c_and_the_links_hand_computed(tmp_path):
    """allreduce at N=2 on this machine: step = 1.05 t_c + 2 a + M / B. The band's throughput
    runs from (t_c high, slow link) to (t_c low, fast link); its efficiency against the
    same corner's N=1 (t_c alone) from (t_c low, slow link) to (t_c high, fast link). t_c:
    the t interval of three N=1 runs; the link: the t intervals of the benchmark's fit."""
    import json

    from scipy import stats

    ring_bytes = 2 * (2 - 1) / 2 * 61706 * 4
    metrics = [
        fake_run(tmp_path / f"a1_{i}", "allreduce", 1, thr, 0.0, 0.0) for i, thr in enumerate((7600.0, 8000.0, 8400.0))
    ]
    metrics += [
        fake_run(tmp_path / "a2", "allreduce", 2, 14000.0, 0.0005, ring_bytes),
        fake_run(tmp_path / "a2b", "allreduce", 2, 15000.0, 0.0006, ring_bytes),
    ]
    bench = band_bench(wobble=(2e-5, -3e-5, 4e-5, -1e-5))
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["allreduce"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2], "hardware": "this_machine"},
    }
    md = tmp_path / "p.md"
    rows = project.run_study(
        metrics, str(tmp_path / "bench.json"), config, str(tmp_path / "p.csv"), str(md), str(tmp_path / "p.png")
    )
    by = {r["workers"]: r for r in rows}
    steps = [64 / thr for thr in (7600.0, 8000.0, 8400.0)]
    mean = sum(steps) / 3
    half = stats.t.ppf(0.975, 2) * math.sqrt(sum((x - mean) ** 2 for x in steps) / 2) / math.sqrt(3)
    t_low, t_high = mean - half, mean + half
    (a_low, a_high), (b_low, b_high) = calibration.line_intervals(bench["allreduce"])
    slow = 2 * (a_high / 2) + 246824 * b_high  # 2 (p-1) alpha + 2 (p-1)/p M / B = intercept + slope M
    fast = 2 * (max(a_low, 0) / 2) + 246824 * b_low
    assert by[2]["throughput"] == pytest.approx(
        128
        / (1.05 * mean + bench["fit"]["allreduce"]["latency_s"] * 2 + 246824 / bench["fit"]["allreduce"]["bandwidth"]),
        rel=1e-9,
    )
    assert by[2]["throughput_low"] == pytest.approx(128 / (1.05 * t_high + slow), rel=1e-9)
    assert by[2]["throughput_high"] == pytest.approx(128 / (1.05 * t_low + fast), rel=1e-9)
    assert by[2]["efficiency_low"] == pytest.approx(t_low / (1.05 * t_low + slow), rel=1e-9)
    assert by[2]["efficiency_high"] == pytest.approx(t_high / (1.05 * t_high + fast), rel=1e-9)
    assert by[2]["throughput_low"] < by[2]["throughput"] < by[2]["throughput_high"]
    # N=1 has no exchange: its band is t_c's alone, and its efficiency is 1 at every corner
    assert (by[1]["throughput_low"], by[1]["throughput_high"]) == pytest.approx((64 / t_high, 64 / t_low), rel=1e-9)
    assert by[1]["efficiency_low"] == pytest.approx(1.0) and by[1]["efficiency_high"] == pytest.approx(1.0)
    # the measured points: the two N=2 runs' mean and range
    assert (by[2]["measured_throughput"], by[2]["measured_throughput_low"], by[2]["measured_throughput_high"]) == (
        14500.0,
        14000.0,
        15000.0,
    )
    text = md.read_text()
    assert f"{by[2]['throughput']:.0f} [{by[2]['throughput_low']:.0f}, {by[2]['throughput_high']:.0f}]" in text
    assert "14500 (14000–15000)" in text
    assert "t_c" in text and "(t95, 3 runs)" in text and "least-squares fits" in text
    with open(tmp_path / "p.csv") as handle:
        written = {int(r["workers"]): r for r in csv.DictReader(handle)}
    assert float(written[2]["efficiency_high"]) == pytest.approx(by[2]["efficiency_high"], rel=1e-5)
    # a GPU profile gives its links: only t_c varies there
    gpu = {**config, "projection": {"workers": [1, 2], "hardware": "h100_ib400"}}
    rows = project.run_study(
        metrics, str(tmp_path / "bench.json"), gpu, str(tmp_path / "p.csv"), str(md), str(tmp_path / "p.png")
    )
    nvlink = 6e-6 + 246824 / (0.824 * 450e9)
    two = next(r for r in rows if r["workers"] == 2)
    assert (two["throughput_low"], two["throughput_high"]) == pytest.approx(
        (128 / (t_high + nvlink), 128 / (t_low + nvlink)), rel=1e-9
    )


def test_band_of_the_parameter_servers_round_trip(tmp_path):
    """r measured on two N=1 parameter-server runs (1.2 and 0.8 ms beyond the model): the band
    takes their range, charged once at N=2; t_c from one run and a benchmark without its
    points hold still."""
    import json

    m = 61706 * 4
    one_way = 5e-5 + m / 2e9
    update = (1 + 4) * m * 5e-11
    modelled = 2 * one_way + update
    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "s1", "ps_sync", 1, 7000.0, modelled + 0.0012, m + PS_REQUEST_BYTES, {"shards": 1}),
        fake_run(tmp_path / "y1", "ps_async", 1, 7100.0, modelled + 0.0008, m + PS_REQUEST_BYTES, {"shards": 1}),
    ]
    bench = {
        "fit": {"allreduce": {"latency_s": 1e-4, "bandwidth": 2e9}, "p2p": {"latency_s": 5e-5, "bandwidth": 2e9}},
        "kernels_s_per_byte": {"server_pass": 5e-11},
        "jitter": {"skew_fraction": 0.0},
        "compute_scale": {"1": 1.0, "2": 1.0},
        "cpu_share": {"1": 1.0, "2": 1.0},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    config = {
        "model": "lenet5",
        "strategies": ["ps_sync"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [2], "hardware": "this_machine"},
    }
    rows = project.run_study(
        metrics,
        str(tmp_path / "bench.json"),
        config,
        str(tmp_path / "p.csv"),
        str(tmp_path / "p.md"),
        str(tmp_path / "p.png"),
    )
    t_c = 64 / 8000
    base = t_c + 2 * (5e-5 + 2 * m / 2e9) + (1 + 4) * m * 5e-11  # the first sum hidden in the phase
    assert rows[0]["throughput"] == pytest.approx(128 / (base + 0.001), rel=1e-9)
    assert (rows[0]["throughput_low"], rows[0]["throughput_high"]) == pytest.approx(
        (128 / (base + 0.0012), 128 / (base + 0.0008)), rel=1e-9
    )


def test_command_has_no_band(tmp_path):
    """A measurement file gives one number per N: no interval to project, the cells stay empty."""
    paths = write_inputs(tmp_path)
    out = tmp_path / "projection.csv"
    assert (
        run_main(
            [
                "project",
                "measured",
                "--measured",
                paths[0],
                "--hardware",
                paths[1],
                "--strategies",
                "allreduce",
                "--workers",
                "1,8,64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    with open(out) as handle:
        written = list(csv.DictReader(handle))
    assert {r["throughput_low"] for r in written} == {""} and {r["measured_throughput_low"] for r in written} == {""}
    assert written[1]["measured_throughput"] == "378"


@pytest.mark.slow
def test_project_rule_adds_its_table_and_plot_to_the_mlflow_study_run(tmp_path):
    """The aggregate step records where its MLflow study run is; the project command (as the
    rule calls it) logs projection.csv, .md and .png to that run, under projection/."""
    import json

    from mlflow import MlflowClient

    from dtstudy.tracking import mlflow_store

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    table = tmp_path / "tables" / "scaling.csv"
    table.parent.mkdir()
    table.write_text("strategy,workers\nallreduce,1\n")
    run_id = mlflow_store.log_study_run(uri, "exp", [], [table])  # ended, as aggregate leaves it
    (tmp_path / "study_run.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": uri, "experiment": "exp"}))
    ring = 2 * (2 - 1) / 2 * 61706 * 4
    metrics = [
        fake_run(tmp_path / "a1", "allreduce", 1, 8000.0, 0.0, 0.0),
        fake_run(tmp_path / "a2", "allreduce", 2, 14000.0, 0.0005, ring),
    ]
    (tmp_path / "bench.json").write_text(json.dumps(band_bench()))
    config = {
        "model": "lenet5",
        "strategies": ["allreduce"],
        "strategy_params": {},
        "stragglers": {},
        "projection": {"workers": [1, 2], "hardware": "this_machine"},
    }
    out = tmp_path / "results/tables/projection.csv"
    assert (
        run_main(
            [
                "project",
                "study",
                "--config-json",
                json.dumps(config),
                "--metrics",
                *metrics,
                "--commbench",
                str(tmp_path / "bench.json"),
                "--out",
                str(out),
                "--out-md",
                str(out.with_suffix(".md")),
                "--plot",
                str(tmp_path / "results/plots/projection.png"),
                "--study-run",
                str(tmp_path / "study_run.json"),
            ]
        )
        == 0
    )
    client = MlflowClient(tracking_uri=uri)
    assert sorted(a.path for a in client.list_artifacts(run_id, "projection")) == [
        "projection/projection.csv",
        "projection/projection.md",
        "projection/projection.png",
    ]
    assert [a.path for a in client.list_artifacts(run_id, "tables")] == ["tables/scaling.csv"]  # kept
    logged = client.download_artifacts(run_id, "projection/projection.csv", str(tmp_path / "back"))
    assert open(logged).read() == out.read_text()


def test_the_validation_against_published_scaling_holds():
    """benchmarks/projection_validation.py (analytic, no timing): every published case is
    projected within 10% of its published efficiency under the model's default (the
    wait-free timeline on each architecture's layer profile), the Horovod ones with the
    hierarchical all-reduce and with the flat ring they ran; at the Horovod servers' full
    line rate, without RoCE's and NCCL's share of it, VGG-16 is not (the share is what that
    verdict rests on)."""
    validation = _benchmark_module("projection_validation")
    assert validation.roce_payload_share(1024) == pytest.approx(1024 / 1106 * 0.96 * 4122 / 4096)
    rows = validation.horovod_cases() + validation.horovod_cases(algorithm="ring") + validation.tf_ec2_cases()
    assert len(rows) == 21
    misses = {row["case"]: round(validation.miss(row), 3) for row in rows if abs(validation.miss(row)) > 0.10}
    assert misses == {}
    line_rate = validation.horovod_cases(algorithm="ring", payload_share=1.0)
    vgg = [validation.miss(row) for row in line_rate if "vgg16" in row["case"]]
    assert min(vgg) > 0.10


RESNET152_ROWS = ["tf_ec2_resnet152_16", "tf_ec2_resnet152_32", "tf_ec2_resnet152_64"]


def test_the_held_out_tf_table_holds_under_the_overlap_the_projection_uses(monkeypatch):
    """The TF EC2 table (ResNets and Inception V3 over 10 Gbit/s Ethernet at 16 to 64 GPUs),
    held out of the model's making, is within 10% under the default the projection uses: the
    study rule's choice of layer profile (calibration.study_layers) and its timeline
    (steps.overlapped), each variable's push behind backward. Controls: under a fixed
    overlap of 0, and with the default gone back to it (no profile chosen; or the timeline
    replaced by the fixed share, 0), ResNet-152's three rows miss, as they did before the
    timeline (-10.2%, -10.9%, -14.6%)."""
    validation = _benchmark_module("projection_validation")

    def misses(rows):
        return {row["key"]: round(100 * validation.miss(row), 1) for row in rows if abs(validation.miss(row)) > 0.10}

    default = validation.tf_ec2_cases()
    assert len(default) == 9 and misses(default) == {}
    assert misses(validation.tf_ec2_cases(validation.TFCase(overlap=0.0))) == dict(
        zip(RESNET152_ROWS, [-10.2, -10.9, -14.6])
    )
    with monkeypatch.context() as planted:
        planted.setattr(calibration, "study_layers", lambda name, parameters: (None, "planted: no profile"))
        assert sorted(misses(validation.tf_ec2_cases())) == RESNET152_ROWS
    fixed_share = steps.overlapped

    def without_timeline(workload, machine, exchange, bucket_cap_mb):
        return fixed_share(dataclasses.replace(workload, layers=None), machine, exchange, bucket_cap_mb)

    monkeypatch.setattr(steps, "overlapped", without_timeline)
    assert sorted(misses(validation.tf_ec2_cases())) == RESNET152_ROWS


def test_the_miss_on_the_tf_table_is_the_overlap_not_fusion_nor_the_baseline():
    """The sensitivities the benchmark prints (one setting changed at a time), as evidence of
    what the fixed overlap of 0 missed on ResNet-152: the pushes hidden behind backward
    take its three rows within 10%, and pushing only after backward puts them back to the
    fixed overlap's misses; fusing the variables or paying a message per variable moves
    them the wrong way (more pessimistic); the single-GPU figure cancels out; the table's
    May 2017 re-run misses as the first table does under overlap 0. A planted model that
    hid nothing behind backward, or paid no latency, fails the first or the third check."""
    validation = _benchmark_module("projection_validation")
    found = validation.tf_sensitivities()

    def resnet152(key, mode="model_default"):
        return [found[key][mode][row] for row in RESNET152_ROWS]

    fixed, projected = resnet152("as_projected", "overlap_zero"), resnet152("as_projected")
    assert min(fixed) < -10 and max(abs(d) for d in projected) < 10
    assert resnet152("pushes_after_backward") == pytest.approx(fixed, abs=0.05)
    for key in ("fused_64_mib", "message_per_variable"):
        assert all(moved < as_is for moved, as_is in zip(resnet152(key), projected)), key
    assert resnet152("single_server_1_gpu", "overlap_zero") == pytest.approx(fixed, abs=1e-6)
    assert min(resnet152("rerun_table", "overlap_zero")) < -10
    # the timeline's verdict does not rest on the link inside that the 8-GPU figure fits
    # (slower than backward is long): read as a slower compute beside a stated link, the same
    assert resnet152("loss_slower_compute") == pytest.approx(projected, abs=0.05)


def test_the_budget_and_the_rule_take_the_timeline_for_the_clusters_model():
    """Where a layer profile fits, the projection's default is the wait-free timeline: the
    study rule picks ResNet-50's profile for config/cluster.yaml's model, and the budget's
    workload carries it, so its all-reduce step says so (Step.overlap)."""
    from dtstudy.config.study_config import deep_merge, read_yaml, validate_schema
    from dtstudy.projection import budget

    config = validate_schema(
        deep_merge(read_yaml(REPO / "config" / "config.yaml"), read_yaml(REPO / "config" / "cluster.yaml"))
    )
    layers, why_not = calibration.study_layers(config["model"], 25_557_032)
    assert layers is not None and layers.name == config["model"] == "resnet50", why_not
    where = budget.load_costing(config["launcher"]["hardware"], config, "launcher.hardware")
    load = budget.workload(config, where.images_per_s, 64)
    assert load.layers is not None
    step = specs.model_step(
        "allreduce", load, where.machine, 64, budget.run_params(config, "allreduce", 64, where.profile)
    )
    assert step.overlap == "wait-free backprop (resnet50)"


def _benchmark_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


ON_MACHINE_RECORDS = sorted(REPO.glob("benchmarks/records/projection_on_machine-*.json"))


def test_two_series_on_this_machine_are_recorded():
    """Two series, not one: the model is held to more than one draw of this machine's noise."""
    assert len(ON_MACHINE_RECORDS) >= 2


def _recorded_rounds(path, folder, monkeypatch):
    """The on-machine benchmark's module, the record at `path`, and each of its rounds through
    the study's `project` rule as the code now stands (projection_on_machine.predicted_vs_measured,
    in a folder of `folder` each): [{strategy: (predicted, measured, low, high) images/s at
    N=2}], and the rule's rows at N=2 on this machine, [{strategy: row}]. The plot is left out
    (it is most of the rule's time and nothing here reads it); the rows are taken as the rule
    hands them to it."""
    on_machine = _benchmark_module("projection_on_machine")
    plotted = []
    monkeypatch.setattr(project, "plot", lambda rows, *_where: plotted.append(rows))
    record = read_json(path)
    rounds, rows = [], []
    for k, measured in enumerate(record["rounds"]):
        (folder / f"round{k}").mkdir(parents=True)
        rounds.append(on_machine.predicted_vs_measured(measured, record["config"], folder / f"round{k}"))
        rows.append({r["strategy"]: r for r in plotted.pop() if r["workers"] == 2 and r["profile"] == "this_machine"})
    return on_machine, record, rounds, rows


#: strategies newer than every record of benchmarks/records/projection_on_machine-*.json
RECORDED_BEFORE_THEY_EXISTED = {"hybrid"}


@pytest.mark.parametrize("path", ON_MACHINE_RECORDS, ids=lambda path: path.stem)
def test_the_model_predicts_the_recorded_n2_runs_of_this_machine(tmp_path, monkeypatch, path):
    """The issue's on-machine target, held on measurements instead of timed here (a test must
    not time this noisy machine): each benchmarks/records/projection_on_machine-*.json holds a
    series of rounds of benchmarks/projection_on_machine.py --record, each one side by side on
    the 2-core machine (the communication benchmark, the N=1 runs, every strategy's N=2 run,
    the N=1 runs and the benchmark again). The study's `project` rule, as the code now stands, calibrated on
    each round's N=1 runs and benchmark, predicts every strategy's N=2 throughput within 15%
    on the medians over the rounds. A change of the model or its calibration that moves a
    strategy out fails here; new records (another machine, another torch) replace the files.
    With LeNet-5 the exchange is 1-6 ms of an 8-13 ms step, so this check alone does not see
    an exchange model off by a factor of 2 (the all-reduce's time doubled stays within 11%):
    test_the_model_predicts_the_exchange_of_the_recorded_n2_runs holds the exchange itself."""
    on_machine, record, rounds, _ = _recorded_rounds(path, tmp_path, monkeypatch)
    assert path.match(on_machine.RECORDS)  # the files the benchmark's --record is documented to write
    assert record["provenance"]["cores"] == 2 and len(record["rounds"]) >= 3
    strategies = record["config"]["strategies"]
    # every strategy with an exchange, but those added after the records were made: the next
    # `--record` run includes them (ON_MACHINE), and they leave this set then
    assert sorted(strategies) == sorted(set(on_machine.ON_MACHINE) - RECORDED_BEFORE_THEY_EXISTED)
    # the measured side is the record's own N=2 runs, not something the model computed
    assert [r["allreduce"][1] for r in rounds] == [
        m["runs"]["results/runs/allreduce/n2/seed0/metrics.json"]["throughput"] for m in record["rounds"]
    ]
    errors = on_machine.verdict(rounds, strategies)
    misses = {strategy: round(error, 3) for strategy, error in errors.items() if abs(error) > on_machine.TOLERANCE}
    assert misses == {}


#: each strategy's predicted exchange seconds per step within this share of the measured, on
#: the medians over a record's rounds; and the sum over the strategies within the second
EXCHANGE_TOLERANCE = 0.40
EXCHANGE_SUM_TOLERANCE = 0.06


def _exchange_errors(record: dict, rows: list[dict]) -> tuple[dict, float]:
    """Each strategy's error (predicted / measured - 1) on its exchange seconds per step at
    N=2, on the medians over the rounds, and the error of their sum over the strategies.
    Measured: the N=2 run's comm_s (a worker's step less its compute: the exchange and the
    waits in it, the partner's jitter and a shard's work included); predicted: the modelled
    step less its compute (the exposed exchange, the shard's update and the barrier's wait)."""
    strategies = record["config"]["strategies"]
    measured = {
        s: statistics.median(
            m["runs"][f"results/runs/{s}/n2/seed0/metrics.json"]["step_time"]["comm_s"] for m in record["rounds"]
        )
        for s in strategies
    }
    predicted = {s: statistics.median(r[s]["step_s"] - r[s]["step_compute_s"] for r in rows) for s in strategies}
    each = {s: predicted[s] / measured[s] - 1 for s in strategies}
    return each, sum(predicted.values()) / sum(measured.values()) - 1


def _exchange_misses(each: dict, total: float) -> tuple[dict, float | None]:
    """The strategies beyond EXCHANGE_TOLERANCE, and the sum's error if beyond its tolerance."""
    return (
        {s: round(e, 3) for s, e in each.items() if abs(e) > EXCHANGE_TOLERANCE},
        round(total, 3) if abs(total) > EXCHANGE_SUM_TOLERANCE else None,
    )


@pytest.mark.parametrize("path", ON_MACHINE_RECORDS, ids=lambda path: path.stem)
def test_the_model_predicts_the_exchange_of_the_recorded_n2_runs(tmp_path, monkeypatch, path):
    """The recorded N=2 runs of this machine (as in the test above), held on what the model is
    about: the seconds per step that the exchange and its waits add, per strategy. The `project`
    rule's prediction (step less compute) against the runs' measured comm_s, on the medians over
    the rounds: each strategy within 40% and the sum over the 12 within 6%.
    On the two records: each strategy within 34.3% (ps_async's, predicted short) and the sums
    within -2.1% and -3.9%.
    Controls, planted in the model as the rule runs it, must fail both parts: the all-reduce's
    time doubled (all-reduce +56% and +73%, sums +10.1% and +7.8%; the throughput check above
    still passes it), no exchange at all (every strategy -33% to -100%, sums -77% to -79%),
    no natural jitter at the barrier (all-reduce -50%, sums -25% and -30%). Not caught: the
    parameter servers' network phases set to 0, since the protocol's cost per round trip is
    calibrated on the N=1 parameter-server runs and takes up what the phases lose."""
    _, record, _, rows = _recorded_rounds(path, tmp_path, monkeypatch)
    each, total = _exchange_errors(record, rows)
    print(f"{path.stem}: sum {total:+.3f}; " + ", ".join(f"{s} {e:+.3f}" for s, e in each.items()))
    assert _exchange_misses(each, total) == ({}, None)

    plain_model_step = project.model_step

    def no_exchange(name, workload, machine, workers, *args, **kwargs):
        s = plain_model_step(name, workload, machine, workers, *args, **kwargs)
        if workers == 1:
            return s
        step_s = s.compute_s + s.straggler_s
        return dataclasses.replace(
            s, exchange_s=0.0, exposed_s=0.0, server_s=0.0, step_s=step_s, throughput=workers * workload.batch / step_s
        )

    plain_allreduce_time = steps.allreduce_time
    planted = {
        "all-reduce x2": (steps, "allreduce_time", lambda *args, **kwargs: 2 * plain_allreduce_time(*args, **kwargs)),
        "no exchange": (project, "model_step", no_exchange),
        "no jitter": (strategy_spec, "natural_wait", lambda *args, **kwargs: 0.0),
    }
    for control, (owner, name, wrong) in planted.items():
        with monkeypatch.context() as patched:
            patched.setattr(owner, name, wrong)
            _, _, _, wrong_rows = _recorded_rounds(path, tmp_path / control.replace(" ", "_"), patched)
        each, total = _exchange_errors(record, wrong_rows)
        print(f"  control {control}: sum {total:+.3f}; " + ", ".join(f"{s} {e:+.3f}" for s, e in each.items()))
        beyond, total_beyond = _exchange_misses(each, total)
        assert beyond and total_beyond is not None, (control, each, total)
