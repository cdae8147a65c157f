"""The bucket plan of our DistributedDataParallel: which gradients travel together, in which order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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
