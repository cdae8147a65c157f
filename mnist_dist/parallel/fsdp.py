"""PyTorch's fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) applied to a plain model
by layer groups; docs/modes.md#fsdp says what a group is, and how checkpoints and buffers behave.
``mnist_dist.parallel.state`` reads and writes the full state under the plain model's keys.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.parallel.ddp import broadcast_from

# torch.distributed.fsdp and .checkpoint are imported inside the functions that need them: they pull
# in DTensor and sympy, about 2 s of CPU that every process of every other mode would pay at start.


def layer_groups(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules sharded as one group each, innermost first: every direct child of ``model`` that has
    parameters, or (``class_names``) every module of those classes."""
    if not class_names:
        return [child for child in model.children() if any(True for _ in child.parameters())]
    found = [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in class_names]
    missing = set(class_names) - {type(m).__name__ for m in found}
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ValueError(
            f"group_classes: the model has no {', '.join(sorted(missing))}; its module classes are {', '.join(classes)}"
        )
    return [m for m in found if any(True for _ in m.parameters())]


def shard(
    model: nn.Module,
    device: torch.device,
    group_classes: list[str] = (),
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """``fully_shard`` on each layer group, then on the root (which takes what no group holds); the process
    group must exist. ``param_dtype``/``reduce_dtype``: forward and backward's copies, the gradients' reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for group in layer_groups(model, list(group_classes)):
        fully_shard(group, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root's output in fp32, so the loss is not computed in bf16.
    root_policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype=torch.float32)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_policy)
    # FSDP2 warns once per rank when a group returns a view (the convnet's features end in Flatten): an
    # in-place op on it would skip a gradient hook. Neither model nor trainer writes to a group's output.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    if any(True for _ in model.buffers()):
        model.register_forward_pre_hook(lambda module, args: broadcast_from(list(module.buffers())))
    return model
