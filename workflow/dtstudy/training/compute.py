"""How a training step computes: on which device (launcher.device), its precision
(train.precision, through autocast, fp16 with a GradScaler) and the memory layout of the model
and its inputs (train.memory_format), as torchvision's classification references and NVIDIA's
ResNet-50 recipe train on a GPU."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

#: train.precision -> autocast's dtype (None: no autocast, everything in fp32)
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: train.memory_format -> the layout of 4-d weights and inputs; `auto` is resolved per device
MEMORY_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.preserve_format}


def pick_device(preference: str, local_rank: int, workers_per_node: int = 1) -> torch.device:
    """The device of a worker: its own GPU on CUDA, else the CPU. NCCL refuses two ranks on
    one GPU (its first collective fails with "Duplicate GPU detected"), so a node with fewer
    visible GPUs than workers is an error here, before the run joins its group."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device is 'cuda' but this task sees no GPU")
    gpus = torch.cuda.device_count()
    if workers_per_node > gpus:
        raise RuntimeError(
            f"launcher.device {preference!r}: {workers_per_node} workers on this node but {gpus} visible "
            f"GPU(s); NCCL needs one GPU per worker. Use workers <= {gpus} per node "
            "(launcher.gpus_per_node on SLURM), or launcher.device: cpu (gloo)"
        )
    return torch.device("cuda", local_rank)


def resolve_memory_format(name: str, device: torch.device) -> str:
    """`auto`: channels_last on a GPU (tensor cores read NHWC; the references train so);
    contiguous on the CPU, where the backward passes of ReLU and max-pooling lose more in NHWC
    than the convolutions gain (dtstudy.training.models.inference_layout)."""
    if name == "auto":
        return "channels_last" if device.type == "cuda" else "contiguous"
    return name


@dataclass
class Compute:
    """A run's precision and layout, and the GradScaler of an fp16 run."""

    precision: str
    memory_format: str  # resolved: channels_last or contiguous
    device: torch.device

    @classmethod
    def from_config(cls, train: dict, device: torch.device) -> Compute:
        return cls(train["precision"], resolve_memory_format(train["memory_format"], device), device)

    def __post_init__(self):
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(f"train.precision: {self.precision!r}; allowed: {', '.join(AUTOCAST_DTYPES)}")
        # fp16's range needs the loss scaled (bf16 has fp32's exponent and needs none)
        self.grad_scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    @property
    def layout(self) -> torch.memory_format:
        return MEMORY_FORMATS[self.memory_format]

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in the run's layout (before a strategy wraps it: DDP keeps the strides)."""
        if self.memory_format == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        return model

    def inputs(self, inputs: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch on the device in the run's layout (a copy that does not wait for the host)."""
        return inputs.to(device, non_blocking=True, memory_format=self.layout)

    def autocast(self):
        """The forward pass's context: autocast to the run's dtype (fp32: none at all)."""
        dtype = AUTOCAST_DTYPES[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on: the loss, times the GradScaler's scale under fp16."""
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def describe(self, clock_kind: str) -> dict:
        """metrics.json's `compute`: what the steps ran with (the GPU's kernel settings are in
        `environment.kernels`). Reads the GradScaler's scale: call after training."""
        scaler = None
        if self.grad_scaler is not None:
            scaler = {
                "final_scale": float(self.grad_scaler.get_scale()),
                "growth_interval": self.grad_scaler.get_growth_interval(),
            }
        dtype = AUTOCAST_DTYPES[self.precision]
        return {
            "precision": self.precision,
            "autocast_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "grad_scaler": scaler,
            "memory_format": self.memory_format,
            "timing_clock": clock_kind,
        }
