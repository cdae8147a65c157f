"""A wrapped model's state as the plain model's: what a checkpoint saves and a resume loads, in every mode."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.parallel import wrappers
from mnist_dist.parallel.ddp import broadcast_from


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an outer wrapper, for evaluation without wrapper machinery."""
    return model.module if wrappers.of(model).outer else model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict the plain model would have: no ``module.`` from a wrapper, outer or inner
    (dp_block wraps a submodule), so checkpoints load into the bare model class."""
    model = unwrap(model)
    inner = [f"{name}." for name, m in model.named_modules() if name and wrappers.of(m).outer]
    state = {}
    for key, value in model.state_dict().items():
        for prefix in inner:
            if key.startswith(prefix + "module."):
                key = prefix + key[len(prefix + "module.") :]
        state[key] = value
    return state


def buffers_from_rank0(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers of ``model`` (any wrapper, or none): the BatchNorm statistics a
    checkpoint saves, where each rank's last forward updated its own. Nothing in one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_from(list(model.buffers()))


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Gathered on every rank, kept by rank 0 only; on the CPU, so a GPU needs no room for a full copy.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state_dict, copied to the CPU, so that it loads where no GPU is (a collective in fsdp:
    every rank calls; rank 0's copy is complete)."""
    if not wrappers.of(model).sharded:
        return {key: value.detach().to("cpu", copy=True) for key, value in plain_state_dict(model).items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options())


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state_dict (a collective in fsdp, keyed by parameter name, not by position)."""
    if not wrappers.of(model).sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options())


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Puts a checkpoint's optimizer state into ``optimizer``: in fsdp each rank keeps its own shard."""
    if not wrappers.of(model).sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    if any(isinstance(key, int) for key in state["state"]):  # written by another mode: keyed by position
        state = {
            "state": {names[key]: value for key, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    if not any(isinstance(v, torch.Tensor) for entry in state["state"].values() for v in entry.values()):
        # Nothing to shard (SGD without momentum): torch's loader cannot tell the device and raises, and
        # the hyperparameters are all there is to restore.
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
