"""What each wrapper can do, declared once per class in ``DECLARED`` (yours: ``DECLARED[MyWrapper] = Wrapper(...)``);
callers ask ``of(model)``, never the model. ``fsdp.shard`` declares FSDP2's modules where it imports FSDP, so a
process that never shards never pays for that import."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.parallel.ddp import DistributedDataParallel
from mnist_dist.parallel.dp import FunctionalDataParallel


@dataclass(frozen=True)
class Wrapper:
    outer: bool = False  # the model is its .module (FSDP2 shards the model in place)
    no_sync: bool = False  # model.no_sync(): forward and backward only accumulate local gradients
    sharded: bool = False  # each rank holds a shard: a state dict is gathered, a collective (state.py)
    clock: Callable[[nn.Module], object] = lambda model: None  # what times its backward (timing.py)
    counters_ns: Callable[[nn.Module], dict | None] = lambda model: None  # torch DDP's backward averages
    bucket_bytes: Callable[[nn.Module], int] = lambda model: 0  # its gradient buckets that are not .grad
    local: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor  # this rank's part (fsdp: its shard)


def of(model: nn.Module) -> Wrapper:
    """What ``model``'s wrapper can do: the declaration of its class or of the nearest base that has one."""
    return next((DECLARED[cls] for cls in type(model).__mro__ if cls in DECLARED), Wrapper())


def _our_buckets(model: DistributedDataParallel) -> int:
    # Flat buffers and compress_bf16's copies; with gradient_as_bucket_view a flat buffer is the gradients.
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    storages = [tensor.untyped_storage() for tensor in model.bucket_buffers]
    return sum(storage.nbytes() for storage in storages if storage.data_ptr() not in grads)


def _torch_buckets(model: TorchDDP) -> int:
    # The reducer's flat buckets (reducer.cpp), cut by the same caps as ours, a lone gradient's too (ours reduces
    # that in .grad); with gradient_as_bucket_view they are the gradients.
    sizes = model._get_ddp_logging_data()["bucket_sizes"].split(",")
    return 0 if model.gradient_as_bucket_view else sum(int(size) for size in sizes)


DECLARED: dict[type, Wrapper] = {
    DistributedDataParallel: Wrapper(
        outer=True,
        no_sync=True,
        clock=lambda model: model.clock,  # attached by its user (the app: modes.py), or None
        counters_ns=lambda model: None if model.clock is None else model.clock.averages_ns(),
        bucket_bytes=_our_buckets,
    ),
    TorchDDP: Wrapper(
        outer=True, no_sync=True, counters_ns=TorchDDP._get_ddp_logging_data, bucket_bytes=_torch_buckets
    ),
    nn.DataParallel: Wrapper(outer=True),
    FunctionalDataParallel: Wrapper(outer=True),
}
