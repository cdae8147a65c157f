"""Rank 0's tensors to every rank: the one broadcast every wrapper uses for parameters and buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def broadcast_from(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrites ``tensors`` on every rank with rank ``src``'s (a collective: every rank calls, same order).

    One broadcast per device and dtype, of the tensors flattened together: a BatchNorm net has a few
    small buffers per layer, and a collective's latency, not its bytes, is what they cost.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        if len(group) == 1:
            dist.broadcast(group[0], src=src)
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        dist.broadcast(flat, src=src)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """``broadcast_from(tensors, 0)``. Our DDP calls it for the parameters at wrap time and for the buffers
    (BatchNorm's running statistics) before forwards; fsdp for the buffers, which it does not shard."""
    broadcast_from(tensors, src=0)


def buffers_from_rank0(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers of ``model`` (any wrapper, or none), e.g. before an evaluation:
    each rank's last training forward updated its BatchNorm statistics from its own share, and rank 0's
    are the ones a checkpoint saves. Nothing in one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_from_rank0(list(model.buffers()))
