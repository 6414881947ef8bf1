"""The compressed all-reduces' specs (torch-free): fp16 and bf16 casts, PowerSGD, 1-bit SGD."""

from __future__ import annotations

from dtstudy.perfmodel import steps
from dtstudy.strategies.allreduce.spec import AllReduceSpec


class AllReduceFP16Spec(AllReduceSpec):
    name = "allreduce_fp16"
    family = "compressed"
    # a 16-bit cast reads 4 and writes 2 bytes per value and back: ~3 passes of the fp32 bytes
    compression_passes = 3.0
    wire_value_bytes = 2  # half the bytes

    @classmethod
    def wire_bytes(cls, workload):
        return workload.parameters * float(cls.wire_value_bytes)


class AllReduceBF16Spec(AllReduceFP16Spec):
    name = "allreduce_bf16"


class AllReducePowerSGDSpec(AllReduceSpec):
    name = "allreduce_powersgd"
    family = "compressed"
    no_fp16_because = (
        "its error feedback keeps residuals of the loss-scaled gradients: a change of the "
        "scale leaves them off by that factor and an overflowing step's inf stays in them"
    )
    # rank r: two matrix products over the gradient and the error feedback, ~6 passes
    compression_passes = 6.0
    needs_matrices = True  # which matrices it factorises depends on their shapes
    #: a matrix is factorised only when that makes it this many times smaller (torch's
    #: PowerSGDState default, which the strategy keeps)
    MIN_COMPRESSION_RATE = 2

    @classmethod
    def sent_share(cls, matrices, rank: int) -> float:
        """Share of the gradient's values PowerSGD all-reduces: a matrix n x m goes as rank-r P
        (n x r) and Q (m x r) when that is smaller by MIN_COMPRESSION_RATE (torch's
        `_should_compress`), whole otherwise; a vector [n, 1] always goes whole."""
        total = sent = 0
        for n, m in matrices:
            total += n * m
            sent += (n + m) * rank if (n + m) * rank * cls.MIN_COMPRESSION_RATE < n * m else n * m
        return sent / total

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        """torch's hook all-reduces three times per bucket, one after the other: the tensors it
        sends whole (vectors, matrices too small to gain), then the rank-r factors P, then Q
        (each needs the one before); the bytes are the share of the gradient's that its runs
        measured, or `sent_share` of the model's matrices at the rank knob."""
        share = workload.measured_share.get(cls.name)
        if share is None:
            if workload.matrices is None:
                raise ValueError(
                    f"{cls.name} needs the share of the gradient bytes PowerSGD sends "
                    "(a run's measured bytes_per_step at N > 1, or the model's matrices)"
                )
            share = cls.sent_share(workload.matrices, params["rank"])
        return steps.allreduce_step(
            cls.name,
            workload.model_bytes * share,
            cls.compression_passes,
            workload,
            machine,
            workers,
            params,
            stragglers,
            messages_per_bucket=3,
        )

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        return None  # its bytes depend on the matrices' shapes

    @classmethod
    def exchange_cycle(cls, params):
        """Its first `start_powerSGD_iter` steps all-reduce the whole gradient (torch's hook)."""
        return params["start_powerSGD_iter"], 1

    @classmethod
    def validate(cls, params, workers):
        # PowerSGD's state (warm start, error feedback) needs a plain step first
        stateful = params["warm_start"] or params["use_error_feedback"]
        if stateful and params["start_powerSGD_iter"] < 2:
            raise cls.bad_knob(
                "start_powerSGD_iter",
                params["start_powerSGD_iter"],
                "an integer >= 2 is needed while warm_start or use_error_feedback is true",
            )


class AllReduceOneBitSpec(AllReduceSpec):
    name = "allreduce_onebit"
    family = "compressed"
    no_fp16_because = AllReducePowerSGDSpec.no_fp16_because
    # residual add, |x| mean, sign pack, dequantise and new residual: ~6 passes
    compression_passes = 6.0

    @classmethod
    def step_model(cls, workload, machine, workers, params, stragglers):
        return steps.onebit_step(cls.name, cls.compression_passes, workload, machine, workers, params, stragglers)

    @classmethod
    def parameters_from_bytes(cls, bytes_per_step, workers, params):
        return None  # its bytes depend on the tensors and column groups its quantiser scales


#: the 1-bit quantizers (the schema's enum of its `quantizer` knob; onebit_codec implements them)
ONEBIT_QUANTIZERS = tuple(AllReduceOneBitSpec.knob_schema["properties"]["quantizer"]["enum"])
