"""The performance model (dtstudy.perfmodel) against published scaling measurements.

Each case is projected from its source's own single-GPU (and, where published, single-node)
throughput and the hardware the source documents; nothing is fitted to the multi-node
figure. The same model settings apply to every case: fp32 gradients, one all-reduce per
fusion buffer / bucket, links at their payload rate (the share of the stated rate that
framing and the transport leave to the gradient bytes, with its sources below). Three ways the exchange hides behind backward, side by side: a fixed
overlap 0 (the model's default) and 0.5 (sensitivity, not a fit), and the wait-free-backprop
timeline on each architecture's layer profile (dtstudy.projection.layer_profiles: where its parameters
sit and when backprop produces their gradients, from torch's FLOP counter; no constant of it
is set from a published figure); and the last of them again with the all-reduce as one flat
ring through every GPU, the algorithm Horovod ran then, instead of the model's default
hierarchical one. Prints published vs projected with the source of each.

    python3 benchmarks/projection_validation.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from scipy.optimize import brentq  # noqa: E402

from dtstudy.projection import layer_profiles
from dtstudy.perfmodel import collectives, steps
from dtstudy.strategies import specs
from dtstudy.perfmodel.machine import Link, Machine, Workload

HOROVOD = "https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst"
TF_BENCH = "https://www.tensorflow.org/performance/benchmarks (TF 1.x, tensorflow/docs r1 guide/performance/benchmarks.md)"
AWS_P2 = "https://aws.amazon.com/ec2/instance-types/p2/ (p2.8xlarge: 8 GPUs, 10 Gigabit network)"

# parameters (fp32): torchvision / Keras model summaries
PARAMETERS = {"inception_v3": 23_851_784, "resnet50": 25_557_032, "resnet101": 44_549_160,
              "resnet152": 60_192_808, "vgg16": 138_357_544}

# Horovod's 512-GPU run: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE, batch 64 per GPU (the
# docs' tf_cnn_benchmarks command). Single-GPU rates: TF benchmarks, one P100, synthetic data,
# batch 64 (Inception V3 142, VGG16 132 images/s); ResNet-101 is in neither source: its time
# per image interpolated by depth between ResNet-50 (238) and ResNet-152 (95.6): ~136 images/s.
_T50, _T152 = 1 / 238, 1 / 95.6
P100_SINGLE = {"inception_v3": 142.0, "vgg16": 132.0,
               "resnet101": 1 / (_T50 + (_T152 - _T50) * (101 - 50) / (152 - 50))}
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
NCCL_SHARE = ("https://github.com/NVIDIA/nccl src/graph/topo.h (NET_BW, PCI_BW) and tuning.cc; "
              "https://github.com/NVIDIA/nccl-tests/issues/119 (24 GB/s per 200G NIC)")
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
# instances) and ResNet-152 (4 on 8).
TF_EC2 = {
    "inception_v3": {"batch": 64, 1: 29.7, 8: 229, 16: 459, 32: 902, 64: 1783, "shards_at_64": 6},
    "resnet50": {"batch": 64, 1: 55.0, 8: 410, 16: 825, 32: 1468, 64: 3051, "shards_at_64": 8},
    "resnet152": {"batch": 32, 1: 19.8, 8: 150, 16: 300, 32: 575, 64: 1004, "shards_at_64": 4},
}
# documented: 10 Gigabit; latency assumed (TCP/gRPC, ~50 us); TCP over IPv4 in jumbo frames
# (9001-byte MTU, which AWS's current generation of instances supports, the p2 then among
# them; ASSUMED used): 8949 bytes of payload (less 20 IP, 20 TCP, 12 timestamps) per 9039
# on the wire (+ Ethernet header 14, FCS 4, preamble 8, inter-frame gap 12)
EC2_INTER = Link(50e-6, 10e9 / 8 * wire_share(9001 - 52, 52 + 38))


# Horovod's earlier README (2017; kept in forks of uber/horovod, e.g. github.com/bobohuang/horovod):
# "32 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network": 90%
# for Inception V3 and ResNet-101, 79% for VGG-16 (128 GPUs)
HOROVOD_2017 = "https://github.com/bobohuang/horovod (Horovod README of 2017, 128 GPUs)"
HOROVOD_PUBLISHED = {512: (HOROVOD, {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.68}),
                     128: (HOROVOD_2017, {"inception_v3": 0.90, "resnet101": 0.90, "vgg16": 0.79})}


def _layers(name: str, wait_free: bool):
    return layer_profiles.load(name, "projection_validation.py: architecture") if wait_free else None


def horovod_cases(overlap: float = 0.0, wait_free: bool = False, algorithm: str = "hierarchical",
                  payload_share: float = roce_payload_share(ROCE_MTU)) -> list[dict]:
    """`wait_free`: each architecture's layer profile, Horovod's 64 MiB fusion buffers filled
    in backprop order (perfmodel's DDP-style buckets), instead of the fixed `overlap`.
    `algorithm`: how the all-reduce spans the servers (perfmodel.collectives.ALLREDUCE_ALGORITHMS);
    Horovod then ran NCCL 2's flat ring ("ring"): its hierarchical mode came in v0.13.6, July
    2018 (https://github.com/horovod/horovod/pull/329), after both benchmarks. `payload_share`:
    the share of the servers' 25 Gbit/s that carries gradient bytes."""
    machine = dataclasses.replace(horovod_machine(payload_share), overlap=overlap, allreduce_algorithm=algorithm)
    rows = []
    for gpus, (source, published) in HOROVOD_PUBLISHED.items():
        for name, efficiency in published.items():
            workload = Workload(PARAMETERS[name], 4, 64, compute_s=64 / P100_SINGLE[name],
                                layers=_layers(name, wait_free))
            params = {"bucket_cap_mb": HOROVOD_FUSION_MB}
            single = specs.model_step("allreduce", workload, machine, 1, params).throughput
            s = specs.model_step("allreduce", workload, machine, gpus, params)
            rows.append({"source": source,
                         "case": f"Horovod {name}, {gpus} GPUs ({gpus // 4} x 4 Pascal, 25 Gbit/s RoCE)",
                         "published": efficiency, "projected": s.throughput / (gpus * single), "bound": s.bound})
    return rows


def hierarchical_ps_exchange(workload: Workload, machine: Machine, workers: int, shards: int) -> float:
    """distributed_replicated: gradients summed over a node's GPUs (ring all-reduce inside),
    then each node pushes its sum to the shards and pulls the parameters: a parameter server
    with one worker per node (steps.ps_phase_time with gpus_per_node 1), both phases."""
    g = machine.gpus_per_node
    nodes = machine.nodes(workers)
    inside = collectives.ring_allreduce_time(workload.model_bytes, min(workers, g), machine.intra)
    if nodes == 1:
        return inside
    per_node = dataclasses.replace(machine, gpus_per_node=1, intra_p2p=machine.inter_p2p or machine.inter)
    return inside + 2 * steps.ps_phase_time(workload, per_node, nodes, shards, "colocated")


def tf_step(workload: Workload, machine: Machine, workers: int, shards: int) -> float:
    """One distributed_replicated step. Fixed overlap: compute + the exchange less overlap x
    compute. Wait-free (the workload's layer profile): TF's dataflow sums each variable's
    gradient over the node's GPUs and pushes it as soon as backprop has produced it (one
    bucket per variable, its share of the bytes; the sum inside and the push are on different
    links, so one variable's push runs beside the next one's sum); the pull of the updated
    variables follows the update (exposed)."""
    inside = hierarchical_ps_exchange(workload, machine, min(workers, machine.gpus_per_node), shards)
    exchange = hierarchical_ps_exchange(workload, machine, workers, shards)
    if workload.layers is None:
        return workload.compute_s + max(0.0, exchange - machine.overlap * workload.compute_s)
    push = pull = (exchange - inside) / 2
    variables = workload.layers.buckets(0.0, workload.bytes_per_parameter)
    total = sum(size for size, _ in variables)
    backward = workload.layers.backward_share * workload.compute_s
    timeline = [(ready * backward, inside * size / total, push * size / total) for size, ready in variables]
    return workload.compute_s + steps.wait_free_exposed(timeline, backward) + pull


def fit_tf_intra(workload: Workload, machine: Machine, throughput: float) -> Link:
    """The link inside the instance with which the ring inside makes the published 8-GPU
    rate (the same step model as the multi-node cases; root of log bandwidth)."""
    g = machine.gpus_per_node

    def gap(log_bandwidth: float) -> float:
        trial = dataclasses.replace(machine, intra=Link(0.0, 10 ** log_bandwidth))
        return g * workload.batch / tf_step(workload, trial, g, 1) - throughput

    return Link(0.0, 10 ** brentq(gap, 6, 14))


def tf_ec2_cases(overlap: float = 0.0, wait_free: bool = False) -> list[dict]:
    rows = []
    for name, figures in TF_EC2.items():
        batch = figures["batch"]
        workload = Workload(PARAMETERS[name], 4, batch, compute_s=batch / figures[1], layers=_layers(name, wait_free))
        machine = Machine(8, Link(0.0, float("inf")), EC2_INTER, overlap=overlap)
        machine = dataclasses.replace(machine, intra=fit_tf_intra(workload, machine, figures[8]))
        for n in (16, 32, 64):
            nodes = n // 8
            shards = figures["shards_at_64"] if n == 64 else nodes
            step = tf_step(workload, machine, n, shards)
            throughput = n * batch / step
            rows.append({"source": TF_BENCH, "case": f"TF EC2 {name}, {n} GPUs ({nodes} x p2.8xlarge, {shards} PS)",
                         "published": figures[n] / (n * figures[1]), "projected": throughput / (n * figures[1]),
                         "bound": "network" if step - workload.compute_s > workload.compute_s else "compute"})
    return rows


#: the wait-free columns' labels and how their all-reduce spans the servers
WAIT_FREE_COLUMNS = {"wait-free": "hierarchical", "wait-free, ring": "ring"}

#: the sensitivity column: the exchange hides behind half of the compute (backward is about
#: 2/3 of it and its gradients become ready through it), the same for every case
OVERLAP_SENSITIVITY = 0.5


def main() -> int:
    tf_wait_free = tf_ec2_cases(wait_free=True)  # parameter servers: no all-reduce across nodes
    columns = {"overlap 0": horovod_cases() + tf_ec2_cases(),
               f"overlap {OVERLAP_SENSITIVITY}": horovod_cases(OVERLAP_SENSITIVITY) + tf_ec2_cases(OVERLAP_SENSITIVITY),
               "wait-free": horovod_cases(wait_free=True) + tf_wait_free,
               "wait-free, ring": horovod_cases(wait_free=True, algorithm="ring") + tf_wait_free}
    print(f"{'case':62s} {'published':>9s} " + " ".join(f"{label:>16s}" for label in columns))
    misses = dict.fromkeys(columns, 0)
    for i, row in enumerate(columns["overlap 0"]):
        cells = []
        for label, rows in columns.items():
            diff = rows[i]["projected"] / row["published"] - 1
            misses[label] += abs(diff) > 0.10
            cells.append(f"{100 * rows[i]['projected']:5.1f}% {100 * diff:+6.1f}%{'*' if abs(diff) > 0.10 else ' '}")
        print(f"{row['case']:62s} {100 * row['published']:8.1f}% " + " ".join(f"{c:>16s}" for c in cells))
    print("\nefficiency = throughput(N) / (N x throughput(1)); each column: projected, projected / published - 1; "
          "*: a miss (beyond 10%)")
    print("sources:", HOROVOD, ";", HOROVOD_2017, ";", TF_BENCH, ";", AWS_P2, ";", NCCL_SHARE)
    print("settings for every case: fp32 gradients; links at their payload rate (below); the Horovod cases' ring steps at NCCL's own cost model's latencies "
          f"({NCCL_RING_STEP_PCIE * 1e6:.1f} us over PCIe, {NCCL_RING_STEP_NET * 1e6:.1f} us over the network); "
          "assumptions in each case's comment. Columns: a fixed overlap of "
          f"0 (the model's default) and {OVERLAP_SENSITIVITY} of compute for every case; wait-free: each bucket's "
          "exchange starts when backprop has produced it (layer profiles of dtstudy/layer_profiles.json); the "
          "all-reduce across servers hierarchical (the model's default), or in the last column one flat ring "
          "through every GPU, the algorithm Horovod ran then (the TF cases, parameter servers, are the same)")
    print("; ".join(f"{len(rows) - misses[label]} of {len(rows)} within 10% ({label})" for label, rows in columns.items()))
    print(f"\nlinks at their payload rate: 25 Gbit/s RoCE x {roce_payload_share(ROCE_MTU):.3f} (RoCE v2 framing at "
          f"path MTU {ROCE_MTU}, Ethernet's default, x NCCL's transport {NCCL_TRANSPORT_SHARE:.3f}); 10 Gbit/s TCP "
          f"x {EC2_INTER.bandwidth / (10e9 / 8):.3f} (jumbo frames)")
    print(f"sensitivity, jumbo frames on the Horovod cluster (RoCE path MTU {ROCE_MTU_JUMBO}, x "
          f"{roce_payload_share(ROCE_MTU_JUMBO):.3f}):")
    for label, algorithm in WAIT_FREE_COLUMNS.items():
        jumbo = horovod_cases(wait_free=True, algorithm=algorithm, payload_share=roce_payload_share(ROCE_MTU_JUMBO))
        diffs = [row["projected"] / row["published"] - 1 for row in jumbo]
        print(f"  {label}: " + ", ".join(f"{row['case'].split(' (')[0].removeprefix('Horovod ')} {100 * d:+.1f}%"
                                         for row, d in zip(jumbo, diffs))
              + f"; {sum(abs(d) <= 0.10 for d in diffs)} of {len(diffs)} within 10%")
    print("payload shares of the 25 Gbit/s (0.50 to 1.00 in steps of 0.01) at which all 6 Horovod cases are within 10%:")
    for label, algorithm in WAIT_FREE_COLUMNS.items():
        print(f"  {label}: {shares_within(algorithm)}")
    return 0


def shares_within(algorithm: str, tolerance: float = 0.10) -> str:
    """The payload shares of the Horovod servers' link at which every Horovod case of the
    wait-free column is within `tolerance` of its published efficiency: how much the
    verdict hangs on the share, which no source gives for that cluster."""
    good = [percent for percent in range(50, 101)
            if all(abs(row["projected"] / row["published"] - 1) <= tolerance
                   for row in horovod_cases(wait_free=True, algorithm=algorithm, payload_share=percent / 100))]
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
