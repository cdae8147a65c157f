"""mode=fsdp: PyTorch's fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Every rank holds 1/world_size of each parameter, of its gradient and of the optimizer state; a layer
group's parameters are all-gathered just before the group runs (forward and backward) and its gradients
reduce-scattered (averaged) right after its backward. The model itself never learns of it.

**Layer groups** (one all-gather each): with ``mode.group_classes=[]`` (the default), every direct child
of the model that has parameters (the convnet's and the ResNet's ``features`` and ``classifier``; each
layer of an ``nn.Sequential``); else every module whose class name is listed (e.g.
``[ResidualBlock,Linear]``), innermost first. The root is sharded last and takes what no group holds.

Checkpoints hold the full, unsharded state under the plain model's keys (model.pt loads into the bare
model class); each rank loads its own shard from it on resume. Buffers (BatchNorm's running statistics)
are not sharded: like torch DDP, every forward starts from rank 0's, so model.pt and every rank's
share of the evaluation see the same model.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.errors import ConfigError
from mnist_dist.parallel import plain_state_dict

# torch.distributed.fsdp and .checkpoint are imported inside the functions that need them: they pull
# in DTensor and sympy, about 2 s of CPU that every process of every other mode would pay at start.


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through ``shard``; a process that never imported FSDP holds no FSDP model."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Gathered on every rank, kept by rank 0 only; on the CPU, so a GPU needs no room for a full copy.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def layer_groups(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules sharded as one group each, innermost first (see the module docstring for the rule)."""
    if not class_names:
        return [child for child in model.children() if any(True for _ in child.parameters())]
    found = [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in class_names]
    missing = set(class_names) - {type(m).__name__ for m in found}
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"mode.group_classes: the model has no {', '.join(sorted(missing))}; its module classes are "
            f"{', '.join(classes)}"
        )
    return [m for m in found if any(True for _ in m.parameters())]


def shard(model: nn.Module, mode: Any, device: torch.device) -> nn.Module:
    """``fully_shard`` on each layer group, then on the root; the process group must exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = getattr(torch, mode.param_dtype.name), getattr(torch, mode.reduce_dtype.name)
    model = model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for group in layer_groups(model, list(mode.group_classes)):
        fully_shard(group, mesh=mesh, reshard_after_forward=mode.reshard_after_forward, mp_policy=policy)
    # The root's output in fp32, so the loss is not computed in bf16.
    root_policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype=torch.float32)
    fully_shard(model, mesh=mesh, reshard_after_forward=mode.reshard_after_forward, mp_policy=root_policy)
    # FSDP2 warns once per rank when a group returns a view (the convnet's features end in Flatten): an
    # in-place op on it would skip a gradient hook. Neither model nor trainer writes to a group's output.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    if any(True for _ in model.buffers()):
        model.register_forward_pre_hook(_buffers_from_rank_0)
    return model


def _buffers_from_rank_0(model: nn.Module, args: tuple) -> None:
    for buffer in model.buffers():
        dist.broadcast(buffer, 0)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state_dict (a collective in fsdp: every rank calls; rank 0's copy is complete)."""
    if not _sharded(model):
        return plain_state_dict(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options())


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state_dict (a collective in fsdp, keyed by parameter name, not by position)."""
    if not _sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options())


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Puts a checkpoint's optimizer state into ``optimizer``: in fsdp each rank keeps its own shard."""
    if not _sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    if any(isinstance(key, int) for key in state["state"]):  # written by another mode: keyed by position
        state = {
            "state": {names[key]: value for key, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
