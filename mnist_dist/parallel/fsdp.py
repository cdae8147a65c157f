"""PyTorch's fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) applied to a plain model
by layer groups: each direct child that has parameters, then the root (docs/modes.md#fsdp).
``mnist_dist.parallel.state`` reads and writes the full state under the plain model's keys."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.parallel.ddp import broadcast_from


def shard(model: nn.Module, device: torch.device, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` on each direct child of ``model`` that has parameters, then on the root (which takes
    what no child holds); the process group must exist."""
    # Imported here: DTensor and sympy, about 2 s of CPU that every process of every other mode would pay at start.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for group in [child for child in model.children() if any(True for _ in child.parameters())]:
        fully_shard(group, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # FSDP2 warns once per rank when a group returns a view (the convnet's features end in Flatten): an
    # in-place op on it would skip a gradient hook. Neither model nor trainer writes to a group's output.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    if any(True for _ in model.buffers()):
        model.register_forward_pre_hook(lambda module, args: broadcast_from(list(module.buffers())))
    return model
