"""A wrapped model's state as the plain model's: what a checkpoint saves and a resume loads, in every mode, through
``torch.distributed.checkpoint.state_dict`` (which gathers FSDP's shards and keys the optimizer's state by name)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.parallel.ddp import DistributedDataParallel

# The wrappers that hold the model as their .module, dp.py's included (FSDP2 shards the model in place instead).
OUTER = (DistributedDataParallel, TorchDDP, nn.DataParallel)


def _dcp():
    # Imported when a state is taken: a second of start-up that every worker would pay at import otherwise.
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full():
    # Gathered on every rank, kept by rank 0 only; on the CPU, so that a GPU needs no room for a full copy and the
    # file loads where no GPU is.
    return _dcp().StateDictOptions(full_state_dict=True, cpu_offload=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an outer wrapper, for evaluation without wrapper machinery."""
    return model.module if isinstance(model, OUTER) else model


def _plain_names(model: nn.Module) -> dict[str, str]:
    """torch's name for each parameter and buffer of ``unwrap(model)`` -> the plain model's. torch drops only its
    own DDP's ``module.``; a wrapper around a submodule (dp_block) keeps it, so it is dropped here."""
    inner = [f"{name}.module." for name, m in model.named_modules() if name and isinstance(m, OUTER)]
    names = {}
    for key in model.state_dict():  # features.module.0.weight -> features.0.weight
        prefix = next((p for p in inner if key.startswith(p)), "")
        names[key] = prefix.removesuffix("module.") + key.removeprefix(prefix)
    return names


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the plain model's state_dict on the CPU (a collective where a process group exists: every rank
    calls; rank 0's copy is complete, the others' may be empty)."""
    model = unwrap(model)
    names = _plain_names(model)
    full = _dcp().get_model_state_dict(model, options=_full())
    # A snapshot: of a model on the CPU torch returns the live tensors themselves.
    return {names.get(key, key): value.clone() for key, value in full.items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state_dict, keyed by the plain model's parameter names (so that it loads in any mode),
    on the CPU (a collective, as ``model_state``)."""
    model = unwrap(model)
    return _renamed(_dcp().get_optimizer_state_dict(model, optimizer, options=_full()), _plain_names(model))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Puts ``optimizer_state``'s result into ``optimizer`` (in fsdp each rank keeps its own shard)."""
    model, dcp = unwrap(model), _dcp()
    state = _renamed(state, {plain: key for key, plain in _plain_names(model).items()})
    # torch's full-state loader takes the device from the optimizer's own state; a stateless optimizer (SGD
    # without momentum) has none, and its state is only hyperparameters: loaded as they are.
    has_tensors = any(isinstance(v, torch.Tensor) for entry in state["state"].values() for v in entry.values())
    dcp.set_optimizer_state_dict(model, optimizer, state, options=dcp.StateDictOptions(full_state_dict=has_tensors))


def _renamed(state: dict, names: dict[str, str]) -> dict:
    if not state:  # a rank other than 0: the full state is gathered to rank 0 only
        return state
    return {
        "state": {names.get(key, key): value for key, value in state["state"].items()},
        "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in state["param_groups"]],
    }
