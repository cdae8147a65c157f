"""The buckets of our DistributedDataParallel: which gradients travel together, in which order (the plan),
and how a bucket travels: filled with this rank's share, summed over the ranks, written back into ``.grad``.

The wrapper (ddp.py) decides when each bucket goes, and on which CUDA stream."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Bucket:
    indices: list[int]  # positions in the wrapper's parameter list, in plan order
    buffer: torch.Tensor  # flat, one dtype
    pending: int = 0  # gradients still to arrive in this backward
    work: dist.Work | None = None
    wire: list[torch.Tensor] = field(default_factory=list)  # compress_bf16: one bf16 copy per rank

    def slices(self, params: list[torch.Tensor]):
        """(parameter index, the part of the buffer that holds its gradient), in bucket order."""
        offset = 0
        for i in self.indices:
            numel = params[i].numel()
            yield i, self.buffer[offset : offset + numel]
            offset += numel

    def send(self, params: list[torch.Tensor], divide_by: float) -> None:
        """Fill the buffer with this rank's share of the average and start summing it over the ranks."""
        for i, part in self.slices(params):
            grad = params[i].grad
            if grad is None:  # unused here (find_unused_parameters): contribute zeros
                part.zero_()
            elif grad.data_ptr() == part.data_ptr():  # already there (gradient_as_bucket_view)
                part.div_(divide_by)
            else:  # the copy and the division in one pass over the gradient
                torch.div(grad, divide_by, out=part.view(grad.shape))
        if self.wire:
            self.wire[dist.get_rank()].copy_(self.buffer)
            self.work = dist.all_gather(self.wire, self.wire[dist.get_rank()], async_op=True)
        else:
            self.work = dist.all_reduce(self.buffer, async_op=True)

    def send_zeros(self) -> dist.Work:
        """A joined rank's share (zeros), in the collective the ranks still training launch."""
        if self.wire:
            for part in self.wire:
                part.zero_()
            return dist.all_gather(self.wire, self.wire[dist.get_rank()], async_op=True)
        return dist.all_reduce(self.buffer.zero_(), async_op=True)

    def wait(self) -> None:
        """Wait for the sum; compress_bf16 adds every rank's bf16 share up in fp32 here."""
        self.work.wait()
        if self.wire:
            torch.sum(torch.stack(self.wire), dim=0, dtype=torch.float32, out=self.buffer)

    def write_back(self, params: list[torch.Tensor], used: list[bool] | None, as_view: bool) -> None:
        """The averages into ``.grad``: as views of the buffer (gradient_as_bucket_view), or copies."""
        for i, part in self.slices(params):
            param = params[i]
            if used is not None and not used[i]:  # used on no rank: .grad untouched, as torch DDP
                continue
            if as_view and param.is_contiguous():  # a channels_last one keeps its layout
                if param.grad is None or param.grad.data_ptr() != part.data_ptr():
                    param.grad = part.view(param.shape)
                continue
            if param.grad is None:
                param.grad = torch.empty_like(param)
            param.grad.copy_(part.view(param.shape))


def agreed_order(arrived: list[int], trainable: list[int]) -> list[int]:
    """Rank 0's arrival order, then what rank 0 never saw in reverse registration order (roughly
    backward's): every rank must build the same buckets, since collectives must be issued in the
    same order and sizes on every rank, or they deadlock or mix tensors up."""
    agreed = [arrived]
    dist.broadcast_object_list(agreed, src=0)
    order = list(dict.fromkeys(agreed[0]))
    seen = set(order)
    return order + [i for i in reversed(trainable) if i not in seen]


def build_buckets(
    order: list[int], params: list[torch.Tensor], message_size: int, compress_bf16: bool, world_size: int
) -> list[Bucket]:
    """Consecutive parameters of one dtype, at most ``message_size`` elements per bucket (a flat
    buffer has one dtype; a larger parameter gets a bucket of its own)."""
    groups: list[list[int]] = []
    open_groups: dict[torch.dtype, tuple[list[int], int]] = {}  # dtype -> (indices, elements)
    for i in order:
        dtype, numel = params[i].dtype, params[i].numel()
        indices, size = open_groups.get(dtype, ([], 0))
        if indices and size + numel > message_size:
            groups.append(indices)
            indices, size = [], 0
        open_groups[dtype] = (indices + [i], size + numel)
    groups += [indices for indices, _ in open_groups.values()]
    buckets = []
    for indices in groups:
        first = params[indices[0]]
        numel = sum(params[i].numel() for i in indices)
        bucket = Bucket(indices, torch.empty(numel, dtype=first.dtype, device=first.device))
        if compress_bf16 and first.dtype == torch.float32:
            bucket.wire = [torch.empty(numel, dtype=torch.bfloat16, device=first.device) for _ in range(world_size)]
        buckets.append(bucket)
    return buckets


def refuse_sparse_gradients(module: nn.Module) -> None:
    """At wrap time, naming the parameter: a sparse gradient has no place in a flat buffer."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            raise ValueError(
                f"{name + '.' if name else ''}weight gets sparse gradients, which this DistributedDataParallel "
                "does not average; construct it with sparse=False, or use torch's DistributedDataParallel"
            )
