"""Training patterns people convert, each run with a given DDP wrapper: the equivalence matrix's cases.

Every pattern builds the same model on every rank, wraps it, trains a few optimizer steps on this
rank's share of the global batch and returns what must agree with torch DDP (and, where the pattern
means the same there, with one process on the global batch): parameters, gradients left ``None``,
buffers, eval outputs, or the error it raised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4 ranks
STEPS = 2  # the second on momentum, and on the bucket plan that the first recorded
PATTERNS = {}


def pattern(fn):
    PATTERNS[fn.__name__] = fn
    return fn


class Plain(nn.Module):
    """One process, no wrapper: the reference on the global batch."""

    def __init__(self, module: nn.Module, **_) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def data(step: int, rank: int, world_size: int, features: int = 8, n: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(n, features, generator=g), torch.randn(n, 2, generator=g)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Momentum and weight decay move a parameter whose gradient is zero, not one whose gradient is None.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def params(model: nn.Module) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def train(model, rank, world_size, steps=STEPS, forward=None) -> dict:
    opt = optimizer(model)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = data(step, rank, world_size)
        F.mse_loss((forward or model)(x), y).backward()
        opt.step()
    return params(model)


@pattern
def plain_steps(rank, world_size, wrap):
    return train(wrap(mlp()), rank, world_size)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.Linear(8, 8)
        self.decode = nn.Linear(8, 8)
        self.decode.weight = self.encode.weight  # tied, as input/output embeddings
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.decode(self.encode(x).tanh()).tanh())


@pattern
def tied_weights(rank, world_size, wrap):
    return train(wrap(Tied()), rank, world_size)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8).double()
        self.second = nn.Linear(8, 2)

    def forward(self, x):
        return self.second(self.first(x.double()).tanh().float())


@pattern
def dtype_mix(rank, world_size, wrap):
    return train(wrap(Mixed(), bucket_cap_mb=160 / 2**20), rank, world_size)


class RankOrder(nn.Module):
    """Two branches computed in an order that depends on the rank: hooks fire in another order."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.rank = nn.Linear(8, 2), nn.Linear(8, 2), rank

    def forward(self, x):
        if self.rank % 2:
            b = self.b(x)
            return self.a(x) + b
        return self.a(x) + self.b(x)


@pattern
def arrival_order_differs_across_ranks(rank, world_size, wrap):
    return train(wrap(RankOrder(rank), bucket_cap_mb=40 / 2**20), rank, world_size)


@pattern
def accumulation_without_no_sync(rank, world_size, wrap):
    model = wrap(mlp())
    opt = optimizer(model)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(4):  # each backward syncs; the averaged gradients add up
            x, y = data(10 * step + micro, rank, world_size)
            F.mse_loss(model(x), y).backward()
        opt.step()
    return params(model) | {"grad": model.module[0].weight.grad.clone()}


def train_freezing(model, layer, frozen, rank, world_size, steps):
    """``steps`` steps with ``model.module[layer]`` frozen at the steps in ``frozen``; the parameters after."""
    opt = optimizer(model)
    for step in range(steps):
        model.module[layer].requires_grad_(step not in frozen)
        opt.zero_grad(set_to_none=True)
        x, y = data(step, rank, world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return params(model)


@pattern
def small_bucket_caps(rank, world_size, wrap):
    # 100 floats a bucket: the 16x16 weight alone, the rest in threes and twos; rebuilt from rank 0's order
    return train(wrap(mlp(), bucket_cap_mb=400 / 2**20), rank, world_size, steps=STEPS + 1)


@pattern
def late_freezing_and_unfreezing(rank, world_size, wrap):
    model = wrap(mlp(), find_unused_parameters=True, bucket_cap_mb=400 / 2**20)
    return train_freezing(model, 0, {2, 3}, rank, world_size, 5)  # frozen after the rebuild, then back


@pattern
def non_contiguous_parameters(rank, world_size, wrap):
    net = mlp()
    for layer in (net[0], net[2]):  # transposed storage: dense, not row-major, as channels_last weights are
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())
    net[4].weight = nn.Parameter(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))[::2])  # strided
    return train(wrap(net, bucket_cap_mb=600 / 2**20), rank, world_size)


@pattern
def frozen_at_wrap(rank, world_size, wrap):
    net = mlp()
    net[0].requires_grad_(False)  # a frozen backbone
    return train(wrap(net), rank, world_size)


@pattern
def frozen_at_wrap_then_unfrozen(rank, world_size, wrap):
    net = mlp()
    net[0].requires_grad_(False)
    model = wrap(net)
    result = train(model, rank, world_size, steps=1)
    net[0].requires_grad_(True)
    return train(model, rank, world_size) | {"before": result["params"]}


class Checkpointed(nn.Module):
    """The last layers in a re-entrant checkpoint: backward's first gradients come from a nested backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.tail = nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        return checkpoint(self.tail, self.body(x), use_reentrant=True)


@pattern
def activation_checkpointing_reentrant(rank, world_size, wrap):
    return train(wrap(Checkpointed()), rank, world_size)


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.spare = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, use_spare=False):
        h = self.body(x).tanh()
        return self.head(h) + (self.spare(h) if use_spare else 0)


@pattern
def unused_on_every_rank(rank, world_size, wrap):
    model = wrap(Heads(), find_unused_parameters=True)
    result = train(model, rank, world_size)
    return result | {"spare_grad_is_none": model.module.spare.weight.grad is None}  # as torch's: None, not zeros


@pattern
def unused_on_some_ranks(rank, world_size, wrap):
    model = wrap(Heads(), find_unused_parameters=True)
    return train(model, rank, world_size, forward=lambda x: model(x, use_spare=rank == 1))


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def bn_state(model, outputs) -> dict:
    bn = model.module[1]
    return params(model) | {"running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone()} | outputs


@pattern
def batchnorm_eval_between_steps(rank, world_size, wrap):
    model = wrap(bn_net())
    opt, outputs = optimizer(model), {}
    probe = torch.ones(2, 8)
    for step in range(STEPS):
        model.train()
        opt.zero_grad(set_to_none=True)
        x, y = data(step, rank, world_size)
        F.mse_loss(model(x + rank), y).backward()  # + rank: each rank's statistics drift apart
        outputs[f"after_train_{step}"] = model.module[1].running_mean.clone()
        opt.step()
        model.eval()
        with torch.no_grad():
            for i in range(2):
                outputs[f"eval_{step}_{i}"] = model(probe)
    return bn_state(model, outputs)


@pattern
def batchnorm_no_sync_micro_batches(rank, world_size, wrap):
    model = wrap(bn_net())
    opt, outputs = optimizer(model), {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = data(step, rank, world_size)
        half = len(x) // 2
        with model.no_sync():
            F.mse_loss(model(x[:half] + rank), y[:half]).backward()
        outputs[f"after_no_sync_{step}"] = model.module[1].running_mean.clone()
        F.mse_loss(model(x[half:] + rank), y[half:]).backward()
        outputs[f"after_sync_{step}"] = model.module[1].running_mean.clone()
        opt.step()
    model.eval()
    with torch.no_grad():
        return bn_state(model, outputs | {"eval": model(torch.ones(2, 8))})


@pattern
def batchnorm_without_broadcast_buffers(rank, world_size, wrap):
    model = wrap(bn_net(), broadcast_buffers=False)  # each rank keeps its own statistics
    return bn_state(model, train(model, rank, world_size))


@pattern
def batchnorm_buffer_rebound_after_wrapping(rank, world_size, wrap):
    model = wrap(bn_net())
    model.module[1].running_mean = torch.full((8,), float(rank))  # a new tensor: the one synced from then on
    return bn_state(model, train(model, rank, world_size))


@pattern
def retain_graph_second_backward(rank, world_size, wrap):
    model = wrap(mlp())
    opt = optimizer(model)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = data(step, rank, world_size)
        out = model(x)
        F.mse_loss(out, y).backward(retain_graph=True)
        out.pow(2).mean().backward()
        opt.step()
    return params(model)


def run_all(rank: int, world_size: int, wrap) -> dict:
    """Every pattern's result, or the one line its exception said (a failing pattern does not stop the rest)."""
    results = {}
    for name, fn in PATTERNS.items():
        try:
            results[name] = fn(rank, world_size, wrap)
        except Exception as error:  # noqa: BLE001 - reported per pattern
            results[name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    return results
