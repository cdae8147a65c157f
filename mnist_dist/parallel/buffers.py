"""Rank 0's tensors to every rank: the one broadcast every wrapper uses for parameters and buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrites ``tensors`` on every rank with rank 0's (a collective: every rank calls, same order).

    Our DDP calls it for the parameters at wrap time and for the buffers (BatchNorm's running
    statistics) before forwards; fsdp for the buffers, which it does not shard.
    """
    for tensor in tensors:  # a few small tensors: one collective each keeps this obvious
        dist.broadcast(tensor, src=0)


def buffers_from_rank0(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers of ``model`` (any wrapper, or none), e.g. before an evaluation:
    each rank's last training forward updated its BatchNorm statistics from its own share, and rank 0's
    are the ones a checkpoint saves. Nothing in one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_from_rank0(list(model.buffers()))
