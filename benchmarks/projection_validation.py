"""The performance model (dtstudy.perfmodel) against published scaling measurements.

Each case is projected from its source's own single-GPU (and, where published, single-node)
throughput and the hardware the source documents; nothing is fitted to the multi-node
figure. The same model settings apply to every case: fp32 gradients, one all-reduce per
fusion buffer / bucket, links at their payload rate (the share of the stated rate that
framing and the transport leave to the gradient bytes, with its sources below). Three ways
the exchange hides behind backward, side by side: a fixed overlap 0 (the model's default
where no layer profile fits) and 0.5 (sensitivity, not a fit), and the wait-free-backprop
timeline on each architecture's layer profile (the model's default where one fits, as the
projection and the budget take it: dtstudy.projection.layer_profiles, where its parameters
sit and when backprop produces their gradients, from torch's FLOP counter; no constant of it
is set from a published figure); and the last of them again with the all-reduce as one flat
ring through every GPU, the algorithm Horovod ran then, instead of the model's default
hierarchical one. Prints published vs projected with the source of each; then, for the
held-out TF EC2 table, what its exchange costs a step and how each of its cases moves when
one setting changes (TF_SENSITIVITIES: the overlap, tensor fusion and per-message latency,
the single-GPU and single-instance baseline), under a fixed overlap of 0 and the default.

    python3 benchmarks/projection_validation.py [--record FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from scipy.optimize import brentq

from dtstudy.perfmodel import collectives, steps
from dtstudy.perfmodel.machine import Link, Machine, Workload
from dtstudy.projection import calibration, layer_profiles
from dtstudy.strategies import specs

HOROVOD = "https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst"
TF_BENCH = (
    "https://www.tensorflow.org/performance/benchmarks (TF 1.x, as first published: "
    "https://github.com/tensorflow/tensorflow tensorflow/docs_src/performance/benchmarks.md, Test Date April 2017)"
)
AWS_P2 = "https://aws.amazon.com/ec2/instance-types/p2/ (p2.8xlarge: 8 GPUs, 10 Gigabit network)"

# parameters (fp32): torchvision / Keras model summaries
PARAMETERS = {
    "inception_v3": 23_851_784,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
}

# Horovod's 512-GPU run: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64 per GPU (the
# docs' tf_cnn_benchmarks command). Single-GPU rates: TF benchmarks, one P100, synthetic data,
# batch 64 (Inception V3 142, VGG16 132 images/s); ResNet-101 is in neither source: its time
# per image interpolated by depth between ResNet-50 (238) and ResNet-152 (95.6): ~136 images/s.
_T50, _T152 = 1 / 238, 1 / 95.6
P100_SINGLE = {
    "inception_v3": 142.0,
    "vgg16": 132.0,
    "resnet101": 1 / (_T50 + (_T152 - _T50) * (101 - 50) / (152 - 50)),
}
# A ring step's latency as NCCL's own cost model has it (NVIDIA/nccl src/graph/tuning.cc,
# hwLat of Ring/Simple, the protocol of large messages: 5.7 us over PCIe, 9.6 us over the
# network, times 1.9, its "plateau effect of ring" for a multi-node all-reduce of at least
# nRanks/16 x 64 KiB, which every 64 MiB fusion buffer is); its 8.4 us base per call is left
# out (under 0.2 ms a step). Those constants are of NCCL 2.7 (2020); the runs had NCCL 2 of
# 2017-2018, whose per-step latency is not published.
NCCL_RING_STEP_PCIE = 1.9 * 5.7e-6
NCCL_RING_STEP_NET = 1.9 * 9.6e-6


def wire_share(payload: int, overhead: int) -> float:
    """The share of a link's rate that carries payload, in packets of `payload` bytes with
    `overhead` bytes of headers, trailers and gaps beside each on the wire."""
    return payload / (payload + overhead)


# A link's stated rate is not the rate of the gradient bytes. NCCL gets 12 GB/s of a
# 100 Gbit/s InfiniBand NIC (NET_BW in NVIDIA/nccl src/graph/topo.h; its maintainer: "24GB/s
# is the peak performance per 200G NIC", NVIDIA/nccl-tests#119), 96% of the data rate; of
# that, InfiniBand's own headers at its 4096-byte MTU (LRH 8, BTH 12, ICRC 4, VCRC 2 bytes)
# take 0.6%: the rest is NCCL's transport, 96.6% of what the packets carry.
NCCL_TRANSPORT_SHARE = 0.96 / wire_share(4096, 26)
NCCL_SHARE = (
    "https://github.com/NVIDIA/nccl src/graph/topo.h (NET_BW, PCI_BW) and tuning.cc; "
    "https://github.com/NVIDIA/nccl-tests/issues/119 (24 GB/s per 200G NIC)"
)
# RoCE v2 wraps the same transport in Ethernet: 82 bytes beside each packet on the wire
# (preamble 8, Ethernet header 14 and FCS 4, IPv4 20, UDP 8, BTH 12, ICRC 4, inter-frame
# gap 12), packets of the RoCE path MTU: 1024 bytes on Ethernet's default 1500-byte MTU,
# 4096 with jumbo frames. ASSUMED: the default MTU (the cluster's is not documented); the
# jumbo-frame figure is printed as a sensitivity.
ROCE_MTU, ROCE_MTU_JUMBO = 1024, 4096
ROCE_OVERHEAD = 82


def roce_payload_share(mtu: int) -> float:
    return wire_share(mtu, ROCE_OVERHEAD) * NCCL_TRANSPORT_SHARE


def horovod_machine(payload_share: float) -> Machine:
    return Machine(
        gpus_per_node=4,
        # ASSUMED: PCIe 3.0 x16 between the 4 GPUs of a server (not documented); 12 GB/s is
        # NCCL's own figure for it (PCI_BW in src/graph/topo.h)
        intra=Link(NCCL_RING_STEP_PCIE, 12e9),
        inter=Link(NCCL_RING_STEP_NET, 25e9 / 8 * payload_share),  # documented: 25 Gbit/s RoCE
    )


HOROVOD_FUSION_MB = 64  # Horovod's default tensor-fusion buffer (HOROVOD_FUSION_THRESHOLD = 64 MiB)

# TF benchmarks, Amazon EC2 distributed: p2.8xlarge (8 K80 GPUs), distributed_replicated,
# parameter servers on the worker instances; synthetic data. 1 GPU, 8 GPUs (one instance)
# and 16/32/64 GPUs published; shards: one per instance except Inception V3 (6 on 8
# instances) and ResNet-152 (4 on 8). The table as first published (Test Date April 2017):
TF_EC2 = {
    "inception_v3": {"batch": 64, 1: 29.7, 8: 229, 16: 459, 32: 902, 64: 1783, "shards_at_64": 6},
    "resnet50": {"batch": 64, 1: 55.0, 8: 410, 16: 825, 32: 1468, 64: 3051, "shards_at_64": 8},
    "resnet152": {"batch": 32, 1: 19.8, 8: 150, 16: 300, 32: 575, 64: 1004, "shards_at_64": 4},
}
# The same table re-run (Test Date May 2017, tf_cnn_benchmarks 9165a70), as the archived
# TF 1.x guide has it: other single-GPU and single-instance figures beside other multi-node
# ones (a sensitivity of the baseline, not the held-out table)
TF_BENCH_RERUN = "https://github.com/tensorflow/docs site/en/r1/guide/performance/benchmarks.md (the May 2017 re-run)"
TF_EC2_RERUN = {
    "inception_v3": TF_EC2["inception_v3"],
    "resnet50": {"batch": 64, 1: 52.4, 8: 378, 16: 751, 32: 1388, 64: 2744, "shards_at_64": 8},
    "resnet152": {"batch": 32, 1: 19.4, 8: 146, 16: 291, 32: 565, 64: 981, "shards_at_64": 4},
}
TF_EC2_TABLES = {"April 2017": TF_EC2, "May 2017 re-run": TF_EC2_RERUN}
# One GPU of the same page's single-server p2.8xlarge table (April 2017; no parameter-server
# task: variable_update parameter_server on the CPU for Inception V3, replicated without NCCL
# for the ResNets; the same batches): the single-GPU baseline without the distributed set-up
TF_EC2_SINGLE_SERVER = {"inception_v3": 30.8, "resnet50": 56.3, "resnet152": 20.9}
# documented: 10 Gigabit; latency assumed (TCP/gRPC, ~50 us); TCP over IPv4 in jumbo frames
# (9001-byte MTU, which AWS's current generation of instances supports, the p2 then among
# them; ASSUMED used): 8949 bytes of payload (less 20 IP, 20 TCP, 12 timestamps) per 9039
# on the wire (+ Ethernet header 14, FCS 4, preamble 8, inter-frame gap 12)
EC2_LATENCY_US = 50.0
EC2_PAYLOAD_SHARE = wire_share(9001 - 52, 52 + 38)


def ec2_inter(latency_us: float = EC2_LATENCY_US) -> Link:
    return Link(latency_us * 1e-6, 10e9 / 8 * EC2_PAYLOAD_SHARE)


# Horovod's earlier README (2017; kept in forks of uber/horovod, e.g. github.com/bobohuang/horovod):
# "32 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network": 90%
# for Inception V3 and ResNet-101, 79% for VGG-16 (128 GPUs)
HOROVOD_2017 = "https://github.com/bobohuang/horovod (Horovod README of 2017, 128 GPUs)"
HOROVOD_PUBLISHED = {
    512: (HOROVOD, {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.68}),
    128: (HOROVOD_2017, {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.79}),
}


def _layers(name: str, overlap: float | None):
    """What hides the exchange of `name` behind backward: with `overlap` None, what the
    projection takes by default (calibration.study_layers, the study's rule: the shipped
    layer profile whose parameter count fits, hence the wait-free timeline); with a number,
    no profile (that fixed share of compute)."""
    return calibration.study_layers(name, PARAMETERS[name])[0] if overlap is None else None


def _machine_overlap(machine: Machine, overlap: float | None) -> Machine:
    return machine if overlap is None else dataclasses.replace(machine, overlap=overlap)


def horovod_cases(
    overlap: float | None = None, algorithm: str = "hierarchical", payload_share: float = roce_payload_share(ROCE_MTU)
) -> list[dict]:
    """`overlap` None: the model's default (each architecture's layer profile, Horovod's 64 MiB
    fusion buffers filled in backprop order as perfmodel's DDP-style buckets: the wait-free
    timeline); a number: that fixed share of compute instead.
    `algorithm`: how the all-reduce spans the servers (perfmodel.collectives.ALLREDUCE_ALGORITHMS);
    Horovod then ran NCCL 2's flat ring ("ring"): its hierarchical mode came in v0.13.6, July
    2018 (https://github.com/horovod/horovod/pull/329), after both benchmarks. `payload_share`:
    the share of the servers' 25 Gbit/s that carries gradient bytes."""
    machine = dataclasses.replace(
        _machine_overlap(horovod_machine(payload_share), overlap), allreduce_algorithm=algorithm
    )
    rows = []
    for gpus, (source, published) in HOROVOD_PUBLISHED.items():
        for name, efficiency in published.items():
            workload = Workload(
                PARAMETERS[name], 4, 64, compute_s=64 / P100_SINGLE[name], layers=_layers(name, overlap)
            )
            params = {"bucket_cap_mb": HOROVOD_FUSION_MB}
            single = specs.model_step("allreduce", workload, machine, 1, params).throughput
            s = specs.model_step("allreduce", workload, machine, gpus, params)
            rows.append(
                {
                    "source": source,
                    "key": f"horovod_{name}_{gpus}",
                    "case": f"Horovod {name}, {gpus} GPUs ({gpus // 4} x 4 Pascal, 25 Gbit/s RoCE)",
                    "published": efficiency,
                    "projected": s.throughput / (gpus * single),
                    "bound": s.bound,
                }
            )
    return rows


@dataclasses.dataclass(frozen=True)
class TFCase:
    """How the TF EC2 cases are projected. The defaults are the model's; each sensitivity of
    TF_SENSITIVITIES changes one field, none is set from a multi-node figure."""

    #: None: the projection's default (the layer profile where one fits: the wait-free
    #: timeline); a number: that fixed share of compute, no profile
    overlap: float | None = None
    table: str = "April 2017"  # TF_EC2_TABLES: the published figures
    #: one GPU's images/s per model replacing the table's own (the single-GPU baseline)
    single: dict | None = None
    #: what costs the 8-GPU figure its efficiency, fitted to it: "inside", the sum of the
    #: gradients over the instance's GPUs (a ring on the link inside, the model's); or
    #: "local_ps", the push and pull to the instance's own shard through the host (a link
    #: fitted the same way), which the cross-instance phases then run beside, not after;
    #: "compute", the sum inside at a stated rate and the rest a slower compute (TF_BASELINES)
    baseline: str = "inside"
    #: 0: each variable pushed on its own as backprop produces it (TF's dataflow); more:
    #: variables fused into buckets of this many MiB first (Horovod's tensor fusion)
    bucket_cap_mb: float = 0.0
    #: latency per phase: "node", one message from each instance (the model's, steps.ps_phase_time);
    #: "bucket", one per bucket (per variable unfused) from each instance, one after another
    latency_per: str = "node"
    latency_us: float = EC2_LATENCY_US  # a message between instances (assumed)
    #: False: the pushes start when backward has ended (only the sum inside overlaps it)
    push_overlaps: bool = True


def tf_phase(workload: Workload, machine: Machine, nodes: int, shards: int, case: TFCase, messages: int) -> float:
    """One phase (all pushes, or all pulls) of distributed_replicated: each instance's sum to
    and from the shards, a parameter server with one worker per instance (steps.ps_phase_time
    with gpus_per_node 1, colocated shards: the busiest instance's NIC). `case.latency_per`
    "bucket": each instance's `messages` one after another instead of one. `case.baseline`
    "local_ps": the instance's share of its own shards goes through the host link
    (machine.intra_p2p) beside the NIC."""
    phase = 0.0
    if nodes > 1:
        per_node = dataclasses.replace(machine, gpus_per_node=1, intra_p2p=machine.inter_p2p or machine.inter)
        phase = steps.ps_phase_time(workload, per_node, nodes, shards, "colocated")
        if case.latency_per == "bucket":
            phase += (messages - 1) * nodes * machine.inter.latency_s
    if case.baseline == "local_ps":
        own = min(math.ceil(shards / nodes), shards) / shards
        phase = max(phase, machine.p2p_intra.time(workload.model_bytes * own))
    return phase


def tf_exchange(
    workload: Workload, machine: Machine, workers: int, shards: int, case: TFCase, messages: int
) -> tuple[float, float]:
    """(the sum over the instance's GPUs, one phase) of a distributed_replicated step, seconds."""
    inside = collectives.ring_allreduce_time(workload.model_bytes, machine.local(workers), machine.intra)
    return inside, tf_phase(workload, machine, machine.nodes(workers), shards, case, messages)


def tf_step(workload: Workload, machine: Machine, workers: int, shards: int, case: TFCase, messages: int) -> float:
    """One distributed_replicated step: compute, the exposed part of the sum inside and the
    push (steps.overlapped, the model's own rule: with the layer profile TF's dataflow sums
    each variable over the instance's GPUs and pushes it as soon as backprop has produced
    it, the sum and the push on different links, so one variable's push runs beside the
    next one's sum; without, the fixed overlap), then the pull of the updated variables,
    which follows the update (exposed)."""
    inside, phase = tf_exchange(workload, machine, workers, shards, case, messages)
    if case.push_overlaps:
        exposed = steps.overlapped(workload, machine, (inside, phase), case.bucket_cap_mb)
    else:
        exposed = steps.overlapped(workload, machine, inside, case.bucket_cap_mb) + phase
    return workload.compute_s + exposed + phase


def _root(gap, low: float, high: float) -> float:
    """10 ** x where gap(10 ** x) is 0, low <= x <= high."""
    return 10 ** brentq(lambda x: gap(10**x), low, high)


def fit_inside(workload: Workload, machine: Machine, gap) -> tuple[Workload, Machine]:
    """The 8-GPU figure's loss: the sum over the instance's GPUs; its link fitted."""
    return workload, dataclasses.replace(
        machine,
        intra=Link(0.0, _root(lambda b: gap(workload, dataclasses.replace(machine, intra=Link(0.0, b))), 6, 14)),
    )


def fit_local_ps(workload: Workload, machine: Machine, gap) -> tuple[Workload, Machine]:
    """The 8-GPU figure's loss: the round trip to the instance's own shard; the host link fitted."""
    return workload, dataclasses.replace(
        machine,
        intra_p2p=Link(
            0.0, _root(lambda b: gap(workload, dataclasses.replace(machine, intra_p2p=Link(0.0, b))), 6, 14)
        ),
    )


#: ASSUMED for the "compute" baseline: the sum inside over PCIe 3.0 x16 at NCCL's own figure
#: for it (PCI_BW, as horovod_machine's)
TF_INSIDE_STATED = Link(0.0, 12e9)


def fit_compute(workload: Workload, machine: Machine, gap) -> tuple[Workload, Machine]:
    """The 8-GPU figure's loss: the sum inside at a stated PCIe rate (TF_INSIDE_STATED), the
    rest a slower compute of each GPU of a full instance (shared host, clocks); compute fitted."""
    machine = dataclasses.replace(machine, intra=TF_INSIDE_STATED)
    return dataclasses.replace(
        workload, compute_s=_root(lambda c: gap(dataclasses.replace(workload, compute_s=c), machine), -3, 2)
    ), machine


#: TFCase.baseline -> how the model reads the published 8-GPU figure's loss (fitted to it)
TF_BASELINES = {"inside": fit_inside, "local_ps": fit_local_ps, "compute": fit_compute}


def fit_tf_node(
    workload: Workload, machine: Machine, throughput: float, case: TFCase, messages: int
) -> tuple[Workload, Machine]:
    """The workload and machine that make the published 8-GPU rate (one instance, one shard),
    with the same step model as the multi-node cases, as `case.baseline` reads its loss."""
    g = machine.gpus_per_node

    def gap(trial_workload: Workload, trial_machine: Machine) -> float:
        return g * trial_workload.batch / tf_step(trial_workload, trial_machine, g, 1, case, messages) - throughput

    return TF_BASELINES[case.baseline](workload, machine, gap)


def tf_ec2_cases(case: TFCase = TFCase()) -> list[dict]:
    """The TF EC2 table's 16-, 32- and 64-GPU rows, each projected from the table's 1-GPU and
    8-GPU figures of its model as `case` says (the default: as the model projects them)."""
    rows = []
    for name, figures in TF_EC2_TABLES[case.table].items():
        batch = figures["batch"]
        single = (case.single or {}).get(name, figures[1])
        workload = Workload(PARAMETERS[name], 4, batch, compute_s=batch / single, layers=_layers(name, case.overlap))
        buckets = layer_profiles.load(name, "projection_validation.py").buckets(case.bucket_cap_mb * 2**20, 4)
        machine = _machine_overlap(Machine(8, Link(0.0, float("inf")), ec2_inter(case.latency_us)), case.overlap)
        workload, machine = fit_tf_node(workload, machine, figures[8], case, len(buckets))
        for n in (16, 32, 64):
            nodes = n // 8
            shards = figures["shards_at_64"] if n == 64 else nodes
            step = tf_step(workload, machine, n, shards, case, len(buckets))
            inside, phase = tf_exchange(workload, machine, n, shards, case, len(buckets))
            rows.append(
                {
                    "source": TF_BENCH,
                    "key": f"tf_ec2_{name}_{n}",
                    "case": f"TF EC2 {name}, {n} GPUs ({nodes} x p2.8xlarge, {shards} PS)",
                    "published": figures[n] / (n * single),
                    "projected": n * batch / step / (n * single),
                    "bound": "network" if step - workload.compute_s > workload.compute_s else "compute",
                    "compute_s": workload.compute_s,
                    "inside_s": inside,
                    "phase_s": phase,
                    "exchange_s": inside + 2 * phase,
                    "exposed_s": step - workload.compute_s,
                    "backward_s": workload.layers.backward_share * workload.compute_s if workload.layers else 0.0,
                }
            )
    return rows


#: what the model may miss on the TF EC2 table, each a change of one setting (TFCase):
#: record key -> (label, the change)
TF_SENSITIVITIES = {
    "pushes_after_backward": (
        "overlap: the pushes after backward (only the sum inside overlaps)",
        {"push_overlaps": False},
    ),
    "fused_25_mib": ("fusion: variables fused into 25 MiB buckets", {"bucket_cap_mb": 25.0}),
    "fused_64_mib": ("fusion: variables fused into 64 MiB buckets", {"bucket_cap_mb": 64.0}),
    "message_per_variable": ("latency: a message per variable from each instance", {"latency_per": "bucket"}),
    "message_per_variable_200_us": (
        "latency: the same at 200 us a message",
        {"latency_per": "bucket", "latency_us": 200.0},
    ),
    "rerun_table": (
        "baseline: the table's May 2017 re-run (its own 1- and 8-GPU figures)",
        {"table": "May 2017 re-run"},
    ),
    "single_server_1_gpu": ("baseline: 1 GPU from the single-server table", {"single": TF_EC2_SINGLE_SERVER}),
    "loss_local_ps_round_trip": (
        "baseline: the 8-GPU loss a round trip to the instance's own shard",
        {"baseline": "local_ps"},
    ),
    "loss_slower_compute": (
        "baseline: the 8-GPU loss a slower compute, the sum inside at 12 GB/s",
        {"baseline": "compute"},
    ),
}

#: the columns: label -> (record key, the Horovod rows, the TF rows)
COLUMNS = {
    "overlap 0": ("overlap_zero", lambda: horovod_cases(0.0) + tf_ec2_cases(TFCase(overlap=0.0))),
    "overlap 0.5": ("overlap_half", lambda: horovod_cases(0.5) + tf_ec2_cases(TFCase(overlap=0.5))),
    "wait-free": ("wait_free", lambda: horovod_cases() + tf_ec2_cases()),
    # the TF cases, parameter servers, have no all-reduce across instances: the same
    "wait-free, ring": ("wait_free_flat_ring", lambda: horovod_cases(algorithm="ring") + tf_ec2_cases()),
}

#: the wait-free columns' labels and how their all-reduce spans the servers
WAIT_FREE_COLUMNS = {"wait-free": "hierarchical", "wait-free, ring": "ring"}

TOLERANCE = 0.10


def miss(row: dict) -> float:
    """projected / published - 1"""
    return row["projected"] / row["published"] - 1


def tf_sensitivities() -> dict:
    """{record key: {"label": its label, "overlap_zero" | "model_default": {case key: projected
    / published - 1 in %}}}: each of TF_SENSITIVITIES under a fixed overlap of 0 and under the
    model's default, the model's settings themselves first ("as_projected")."""
    out = {}
    for key, (label, change) in {"as_projected": ("as projected", {}), **TF_SENSITIVITIES}.items():
        out[key] = {"label": label}
        for mode, overlap in (("overlap_zero", 0.0), ("model_default", None)):
            out[key][mode] = {row["key"]: 100 * miss(row) for row in tf_ec2_cases(TFCase(overlap=overlap, **change))}
    return out


def _brief(diffs: dict) -> str:
    """ResNet-152's three rows and how many of the nine are within the tolerance."""
    resnet152 = " ".join(f"{diffs[f'tf_ec2_resnet152_{n}']:+5.1f}" for n in (16, 32, 64))
    within = sum(abs(d) <= 100 * TOLERANCE for d in diffs.values())
    return f"resnet152 {resnet152}%, {within} of {len(diffs)} within 10%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", default=None, help="write every column and sensitivity to this JSON file")
    args = parser.parse_args()
    columns = {label: rows() for label, (_, rows) in COLUMNS.items()}
    print(f"{'case':62s} {'published':>9s} " + " ".join(f"{label:>16s}" for label in columns))
    misses = dict.fromkeys(columns, 0)
    for i, row in enumerate(columns["overlap 0"]):
        cells = []
        for label, rows in columns.items():
            diff = miss(rows[i])
            misses[label] += abs(diff) > TOLERANCE
            cells.append(
                f"{100 * rows[i]['projected']:5.1f}% {100 * diff:+6.1f}%{'*' if abs(diff) > TOLERANCE else ' '}"
            )
        print(f"{row['case']:62s} {100 * row['published']:8.1f}% " + " ".join(f"{c:>16s}" for c in cells))
    print(
        "\nefficiency = throughput(N) / (N x throughput(1)); each column: projected, projected / published - 1; "
        "*: a miss (beyond 10%)"
    )
    print("sources:", HOROVOD, ";", HOROVOD_2017, ";", TF_BENCH, ";", AWS_P2, ";", NCCL_SHARE)
    print(
        "settings for every case: fp32 gradients; links at their payload rate (below); "
        "the Horovod cases' ring steps at NCCL's own cost model's latencies "
        f"({NCCL_RING_STEP_PCIE * 1e6:.1f} us over PCIe, {NCCL_RING_STEP_NET * 1e6:.1f} us over the network); "
        "assumptions in each case's comment. Columns: a fixed overlap of "
        "0 (the model's default where no layer profile fits) and 0.5 of compute for every case; wait-free (the "
        "model's default: the projection and the budget take the architecture's layer profile): each bucket's "
        "exchange starts when backprop has produced it (layer profiles of dtstudy/layer_profiles.json); the "
        "all-reduce across servers hierarchical (the model's default), or in the last column one flat ring "
        "through every GPU, the algorithm Horovod ran then (the TF cases, parameter servers, are the same)"
    )
    print(
        "; ".join(f"{len(rows) - misses[label]} of {len(rows)} within 10% ({label})" for label, rows in columns.items())
    )
    print(
        f"\nlinks at their payload rate: 25 Gbit/s RoCE x {roce_payload_share(ROCE_MTU):.3f} (RoCE v2 framing at "
        f"path MTU {ROCE_MTU}, Ethernet's default, x NCCL's transport {NCCL_TRANSPORT_SHARE:.3f}); 10 Gbit/s TCP "
        f"x {EC2_PAYLOAD_SHARE:.3f} (jumbo frames)"
    )
    print(
        f"sensitivity, jumbo frames on the Horovod cluster (RoCE path MTU {ROCE_MTU_JUMBO}, x "
        f"{roce_payload_share(ROCE_MTU_JUMBO):.3f}):"
    )
    for label, algorithm in WAIT_FREE_COLUMNS.items():
        jumbo = horovod_cases(algorithm=algorithm, payload_share=roce_payload_share(ROCE_MTU_JUMBO))
        diffs = [miss(row) for row in jumbo]
        print(
            f"  {label}: "
            + ", ".join(
                f"{row['case'].split(' (')[0].removeprefix('Horovod ')} {100 * d:+.1f}%" for row, d in zip(jumbo, diffs)
            )
            + f"; {sum(abs(d) <= TOLERANCE for d in diffs)} of {len(diffs)} within 10%"
        )
    print(
        "payload shares of the 25 Gbit/s (0.50 to 1.00 in steps of 0.01) at which all 6 Horovod cases are within 10%:"
    )
    for label, algorithm in WAIT_FREE_COLUMNS.items():
        print(f"  {label}: {shares_within(algorithm)}")

    print(
        "\nwhat the TF EC2 cases' exchange costs a step under the model's default (wait-free), ms: one GPU's "
        "compute (the 8-GPU figure's loss read as the sum inside, whose link is fitted to it), backward, the sum "
        "inside, the push and the pull (one phase each), of all three the part exposed; the rest hides behind "
        "backward"
    )
    print_costs(row for row in columns["wait-free"] if row["key"].startswith("tf_ec2"))
    print(
        f"the same, ResNet-152, with the loss read as a slower compute and the sum inside at "
        f"{TF_INSIDE_STATED.bandwidth / 1e9:g} GB/s (TF_BASELINES 'compute'):"
    )
    print_costs(row for row in tf_ec2_cases(TFCase(baseline="compute")) if "resnet152" in row["key"])
    sensitivities = tf_sensitivities()
    print(
        "\nsensitivity of the TF EC2 cases, one setting changed at a time (projected / published - 1 of ResNet-152 "
        "at 16, 32, 64 GPUs; how many of the 9 TF cases are within 10%; without a layer profile, as under overlap 0, "
        "neither fusion nor when the pushes start changes anything):"
    )
    for modes in sensitivities.values():
        print(
            f"  {modes['label']:70s} overlap 0: {_brief(modes['overlap_zero'])} | "
            f"wait-free: {_brief(modes['model_default'])}"
        )
    print(f"  sources: the re-run {TF_BENCH_RERUN}; the single-server table, the same page as the held-out one")
    if args.record:
        write_record(args.record, columns, misses, sensitivities)
    return 0


def print_costs(rows) -> None:
    for row in rows:
        exchange = row["exchange_s"]
        print(
            f"  {row['case'].removeprefix('TF EC2 '):44s} compute {1e3 * row['compute_s']:5.0f}, backward "
            f"{1e3 * row['backward_s']:5.0f}, inside {1e3 * row['inside_s']:5.0f}, push and pull "
            f"{1e3 * row['phase_s']:4.0f} each, exposed {1e3 * row['exposed_s']:4.0f} "
            f"({100 * (1 - row['exposed_s'] / exchange):.0f}% of the exchange hidden)"
        )


def write_record(path: str, columns: dict, misses: dict, sensitivities: dict) -> None:
    """Every column's cases and the TF sensitivities as JSON, with what reproduces them; the
    differences in % (projected / published - 1)."""
    import platform
    import subprocess
    import time

    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    cases = {}
    for label, rows in columns.items():
        for row in rows:
            entry = cases.setdefault(
                row["key"], {"case": row["case"], "source": row["source"], "published_percent": 100 * row["published"]}
            )
            entry[COLUMNS[label][0]] = {"projected_percent": 100 * row["projected"], "miss_percent": 100 * miss(row)}
    keys = {label: key for label, (key, _) in COLUMNS.items()}
    record = {
        "what": "published multi-node scaling efficiencies (Horovod; TensorFlow 1.x benchmarks on EC2) against the "
        "performance model's projection from each case's single-GPU and single-node figures, per column; "
        "the TF EC2 table's sensitivities, one setting changed at a time (miss_percent: projected / "
        "published - 1, in %)",
        "command": "python3 benchmarks/projection_validation.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"cpu": "analytic: no timing, any machine gives the same", "cores": None},
        "python": platform.python_version(),
        "first_reported": "docs/performance-model.md (Validation against published scaling)",
        "within_10_percent": {keys[label]: [len(rows) - misses[label], len(rows)] for label, rows in columns.items()},
        "cases": cases,
        "tf_ec2_sensitivities": sensitivities,
    }
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}")


def shares_within(algorithm: str, tolerance: float = TOLERANCE) -> str:
    """The payload shares of the Horovod servers' link at which every Horovod case of the
    wait-free column is within `tolerance` of its published efficiency: how much the
    verdict hangs on the share, which no source gives for that cluster."""
    good = [
        percent
        for percent in range(50, 101)
        if all(abs(miss(row)) <= tolerance for row in horovod_cases(algorithm=algorithm, payload_share=percent / 100))
    ]
    if not good:
        return "none"
    runs = [[good[0], good[0]]]  # consecutive percents joined into ranges
    for percent in good[1:]:
        if percent > runs[-1][1] + 1:
            runs.append([percent, percent])
        runs[-1][1] = percent
    return ", ".join(f"{low / 100:.2f} to {high / 100:.2f}" for low, high in runs)


if __name__ == "__main__":
    sys.exit(main())
