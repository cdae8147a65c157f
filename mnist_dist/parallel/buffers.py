"""Rank 0's tensors to every rank: the one broadcast every wrapper uses for parameters and buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrites ``tensors`` on every rank with rank 0's (a collective: every rank calls, same order).

    Our DDP calls it for the parameters at wrap time and for the buffers (BatchNorm's running
    statistics) before forwards; fsdp for the buffers, which it does not shard.
    """
    for tensor in tensors:  # a few small tensors: one collective each keeps this obvious
        dist.broadcast(tensor, src=0)
