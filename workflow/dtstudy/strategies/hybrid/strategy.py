"""Hybrid parallelism (Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
networks"): data parallelism for the layers before the fully connected ones (few parameters,
most of the compute), model parallelism for the fully connected layers (most of the
parameters, little compute).

Every step, on each of the N workers:

1. the layers before the first fully connected one run on the worker's own batch of b images,
   as allreduce's (BatchNorm statistics of its own batch);
2. the first fully connected layer's inputs are all-gathered: every worker holds the N b rows
   of all the workers' batches, in rank order;
3. each fully connected layer keeps out/N of its output neurons (its weight rows and biases;
   the first out mod N workers one more) and computes them for all N b rows; its outputs are
   all-gathered along the features, so that the next layer has every row's whole activation
   vector. The last layer's outputs go instead to the workers whose rows they are (an
   all-to-all): each worker ends with the logits of its own b rows, and the training loop's
   loss is the mean over its own rows with its own labels (no labels are exchanged);
4. backward runs each exchange in reverse: a reduce-scatter (the sum of the N workers'
   gradients of the gathered activations), the reverse all-to-all. The data-parallel layers'
   gradients are averaged by DDP's bucketed all-reduce, overlapped with their backward;
5. the scaling. Worker i's loss L_i is the mean over its b rows; allreduce updates with
   (1/N) sum_i grad L_i, the gradient of the mean loss over the global N b batch. A shard's
   gradient reaches it from every worker's loss, sum_i dL_i/dW_k: it is divided by N. A
   data-parallel gradient on worker i is dL_i alone (other rows never pass through its
   layers) and DDP's average divides the sum by N. The update is allreduce's, to float
   rounding (the fully connected sums are added in another order).

This is the paper's scheme (a), all batches exchanged at once. Its scheme (b) sends one
worker's batch at a time, to overlap the exchange with the fully connected layers' compute,
and lets those layers step per batch of b while the convolutions step per N b: another
optimiser than allreduce's. Scheme (a) keeps the study's question (only the exchange differs).

Bytes, `meter.bytes_sent` (what the ring all-gather and reduce-scatter, the all-to-all and
DDP's ring all-reduce send; dtstudy.perfmodel.steps.hybrid_bytes_per_step): per step,
2 (N-1) [b in_1 + sum over the layers but the last of N b ceil(out/N) + b ceil(out_last/N)]
values, plus 2 (N-1)/N of the data-parallel gradient. Communication seconds: the exchanges'
own time (`meter.timed`), and allreduce's: the time backward runs past the last gradient.

A model qualifies when its nn.Linear modules, in module order, are the chain its forward ends
with: LeNet-5 (three), ResNet-18/50 (the classifier alone). Dropout between them would draw a
different mask on each worker's copy of the activations; the study's models have none.

`eval_model`: the shards all-gathered into a full copy of the model, so what is evaluated and
checkpointed is the plain network, as allreduce's. A preempted run resumes exactly: each
worker saves its own shards and optimizer state. N = 1 trains unwrapped, as allreduce.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtstudy.strategies.allreduce.strategy import AllReduce, ring_allreduce_bytes
from dtstudy.strategies.base import CommMeter, OptimizerFactory
from dtstudy.strategies.hybrid.spec import HybridSpec


class Exchange:
    """What one worker's sharded layers share: the group, the meter, the rows of this forward."""

    def __init__(self, group, rank: int, workers: int, meter: CommMeter):
        self.group, self.rank, self.workers, self.meter = group, rank, workers, meter
        self.rows = 0  # the local batch of the current forward (set by the first layer)
        self.bytes_sent = 0.0  # activations and their gradients, since the start

    def sent(self, tensor: torch.Tensor, messages: int) -> None:
        nbytes = messages * tensor.numel() * tensor.element_size()
        self.meter.bytes_sent += nbytes
        self.bytes_sent += nbytes


class _GatherRows(torch.autograd.Function):
    """b x in on each worker -> the N b x in of all; backward: the reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, exchange: Exchange):
        ctx.exchange = exchange
        x = x.contiguous()
        out = x.new_empty((exchange.workers * x.shape[0], *x.shape[1:]))
        with exchange.meter.timed():
            dist.all_gather_single(out, x, group=exchange.group)
        exchange.sent(x, exchange.workers - 1)
        return out

    @staticmethod
    def backward(ctx, grad):
        exchange = ctx.exchange
        out = grad.new_empty((grad.shape[0] // exchange.workers, *grad.shape[1:]))
        with exchange.meter.timed():
            dist.reduce_scatter_single(out, grad.contiguous(), group=exchange.group)
        exchange.sent(out, exchange.workers - 1)
        return out, None


def _slices_to_features(out: torch.Tensor, workers: int, width: int, keep: torch.Tensor | None) -> torch.Tensor:
    """The N workers' (padded) width-wide slices, stacked by worker (N b' x width), side by side
    along the features (b' x N width), the padding dropped (`keep`: the real columns)."""
    rows = out.shape[0] // workers
    padded = out.view(workers, rows, width).permute(1, 0, 2).reshape(rows, workers * width)
    return padded if keep is None else padded.index_select(1, keep)


def _features_to_slices(grad: torch.Tensor, workers: int, width: int, keep: torch.Tensor | None) -> torch.Tensor:
    """The reverse of `_slices_to_features` (zeros where the padding was): N b' x width."""
    rows = grad.shape[0]
    if keep is not None:
        padded = grad.new_zeros((rows, workers * width))
        padded[:, keep] = grad
        grad = padded
    return grad.view(rows, workers, width).permute(1, 0, 2).reshape(workers * rows, width)


class _GatherColumns(torch.autograd.Function):
    """Each worker's N b x width slice of a layer's outputs -> the whole N b x out on every
    worker (padding dropped); backward: the N workers' gradients summed, each its slice."""

    @staticmethod
    def forward(ctx, y, exchange: Exchange, keep, width: int):
        ctx.exchange, ctx.keep, ctx.width = exchange, keep, width
        n, rows = exchange.workers, y.shape[0]
        y = y.contiguous()
        out = y.new_empty((n * rows, width))
        with exchange.meter.timed():
            dist.all_gather_single(out, y, group=exchange.group)
        exchange.sent(y, n - 1)
        return _slices_to_features(out, n, width, keep)

    @staticmethod
    def backward(ctx, grad):
        exchange, n = ctx.exchange, ctx.exchange.workers
        rows = grad.shape[0]
        slices = _features_to_slices(grad, n, ctx.width, ctx.keep)
        out = grad.new_empty((rows, ctx.width))
        with exchange.meter.timed():
            dist.reduce_scatter_single(out, slices, group=exchange.group)
        exchange.sent(out, n - 1)
        return out, None, None, None


class _ToOwnRows(torch.autograd.Function):
    """Each worker's N b x width slice of the last layer's outputs -> the b x out of its own
    rows (an all-to-all: rows of worker j to worker j); backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, y, exchange: Exchange, keep, width: int):
        ctx.exchange, ctx.keep, ctx.width = exchange, keep, width
        n, rows = exchange.workers, y.shape[0] // exchange.workers
        y = y.contiguous()
        out = torch.empty_like(y)
        with exchange.meter.timed():
            dist.all_to_all_single(out, y, group=exchange.group)
        exchange.sent(y[:rows], n - 1)
        return _slices_to_features(out, n, width, keep)

    @staticmethod
    def backward(ctx, grad):
        exchange, n = ctx.exchange, ctx.exchange.workers
        rows = grad.shape[0]
        back = _features_to_slices(grad, n, ctx.width, ctx.keep)
        out = torch.empty_like(back)
        with exchange.meter.timed():
            dist.all_to_all_single(out, back, group=exchange.group)
        exchange.sent(back[:rows], n - 1)
        return out, None, None, None


def shard_sizes(features: int, workers: int) -> list[int]:
    """Each worker's share of a layer's outputs: out/N, the first out mod N one more."""
    return [features // workers + (rank < features % workers) for rank in range(workers)]


class ShardedLinear(nn.Module):
    """This worker's output neurons of one fully connected layer, and the exchanges around
    it: `entry` (the first layer) gathers the rows of all workers, `last` sends each worker its
    rows; the others gather their outputs along the features. `weight` and `bias` keep the
    full layer's names (this worker's rows of them)."""

    def __init__(self, linear: nn.Linear, exchange: Exchange, entry: bool, last: bool):
        super().__init__()
        sizes = shard_sizes(linear.out_features, exchange.workers)
        start, size = sum(sizes[: exchange.rank]), sizes[exchange.rank]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.exchange, self.entry, self.last = exchange, entry, last
        self.width = max(sizes)  # every worker's slice is padded to it for the collectives
        self.weight = nn.Parameter(linear.weight.detach()[start : start + size].clone())
        self.bias = (
            nn.Parameter(linear.bias.detach()[start : start + size].clone()) if linear.bias is not None else None
        )
        # the real columns among the N padded slices (None: no padding)
        self.keep = (
            None
            if len(set(sizes)) == 1
            else torch.cat([rank * self.width + torch.arange(s) for rank, s in enumerate(sizes)]).to(
                linear.weight.device
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exchange = self.exchange
        if self.entry:
            exchange.rows = x.shape[0]
            x = _GatherRows.apply(x, exchange)
        elif x.shape[0] != exchange.workers * exchange.rows:
            raise RuntimeError(
                f"strategy hybrid: a fully connected layer got {x.shape[0]} rows, not the "
                f"{exchange.workers} x {exchange.rows} of all workers' batches: the model's "
                f"nn.Linear layers must be, in module order, the chain its forward ends with"
            )
        y = F.linear(x, self.weight, self.bias)
        if y.shape[1] < self.width:
            y = F.pad(y, (0, self.width - y.shape[1]))
        return (_ToOwnRows if self.last else _GatherColumns).apply(y, exchange, self.keep, self.width)

    @torch.no_grad()
    def gathered(self, name: str) -> torch.Tensor:
        """The full layer's `weight` or `bias`, from every worker's rows (a collective)."""
        mine = getattr(self, name).detach()
        padded = mine.new_zeros((self.width, *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        out = padded.new_empty((self.exchange.workers * self.width, *mine.shape[1:]))
        dist.all_gather_single(out, padded, group=self.exchange.group)
        return out if self.keep is None else out.index_select(0, self.keep)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.weight.shape[0]} here), entry={self.entry}, last={self.last}"
        )


class Hybrid(AllReduce):
    """Data-parallel layers before the fully connected ones, model-parallel fully connected
    layers (the module docstring has the scheme, the scaling and the bytes). The data-parallel
    part is allreduce's own set-up (DDP, its timing of the exchange behind backward) on the
    model whose fully connected layers were split first and are ignored by DDP."""

    spec = HybridSpec
    # the state is each worker's own (its shards, their optimizer state, the replicated
    # layers); DDP rebuilds its buckets after the first step, as allreduce's

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        ctx = self.ctx
        model.to(ctx.device)
        self.sharded: dict[str, ShardedLinear] = {}
        self.shard_parameters: list[nn.Parameter] = []
        self.steps, self.gradient_bytes = 0, 0.0
        if ctx.workers == 1:  # nothing to split or exchange: trains unwrapped, as allreduce
            return super().setup(model, make_optimizer)
        self.full = copy.deepcopy(model)  # what is evaluated and checkpointed (eval_model)
        self.exchange = Exchange(ctx.worker_group, ctx.rank, ctx.workers, self.meter)
        linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        if not linears:
            raise ValueError("strategy hybrid: the model has no fully connected (nn.Linear) layer to split")
        for i, (name, linear) in enumerate(linears):
            parent, _, child = name.rpartition(".")
            self.sharded[name] = ShardedLinear(linear, self.exchange, entry=i == 0, last=i == len(linears) - 1)
            setattr(model.get_submodule(parent), child, self.sharded[name])
        split = sorted(f"{name}.{leaf}" for name, layer in self.sharded.items() for leaf, _ in layer.named_parameters())
        self.shard_parameters = [p for layer in self.sharded.values() for p in layer.parameters()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, split)
        return super().setup(model, make_optimizer)

    def bytes_per_step(self) -> float:
        """The ring all-reduce of the data-parallel gradient (the activations count as they go)."""
        shards = {id(p) for p in self.shard_parameters}
        payload = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad and id(p) not in shards
        )
        return ring_allreduce_bytes(payload, self.ctx.workers)

    def backward(self, loss) -> None:
        super().backward(loss)
        if self.ctx.workers == 1:
            return
        self.steps += 1
        self.gradient_bytes += self._plain_bytes_per_step
        # every worker's loss reached the shards: the sum of N per-worker means -> their mean
        for parameter in self.shard_parameters:
            if parameter.grad is not None:
                parameter.grad.div_(self.ctx.workers)

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        if self.ctx.workers == 1:
            return self.model
        current = self.model.state_dict()
        for key, value in self.full.state_dict().items():
            layer, _, leaf = key.rpartition(".")
            value.copy_(self.sharded[layer].gathered(leaf) if layer in self.sharded else current[key])
        return self.full

    def summary(self) -> dict:
        if self.ctx.workers == 1:
            return {}
        layers = list(self.sharded.values())
        steps = max(self.steps, 1)
        return {
            "model_parallel_layers": [[layer.in_features, layer.out_features] for layer in layers],
            "model_parallel_parameters": sum(
                (layer.in_features + (layer.bias is not None)) * layer.out_features for layer in layers
            ),
            "activation_bytes_per_step": self.exchange.bytes_sent / steps,
            "gradient_bytes_per_step": self.gradient_bytes / steps,
        }
