"""Applying a mode to a plain model: the one place where distribution enters the model.

``from mnist_dist.parallel import DistributedDataParallel`` gives the hand-written DDP on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.config import ModeConfig
from mnist_dist.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "wrap_model", "unwrap", "gradient_sync"]


def wrap_model(model: nn.Module, mode: ModeConfig, device: torch.device) -> nn.Module:
    """Moves ``model`` to ``device`` and wraps it for ``mode``; the process group must exist for ddp modes."""
    model = model.to(device)
    if mode.name == "ddp":
        return DistributedDataParallel(
            model,
            message_size=mode.message_size,
            overlap=mode.overlap,
            find_unused_parameters=mode.find_unused_parameters,
        )
    if mode.name == "torch_ddp":
        return TorchDDP(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=mode.find_unused_parameters,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper, so checkpoints carry no ``module.`` prefix."""
    return model.module if isinstance(model, (DistributedDataParallel, TorchDDP)) else model


def gradient_sync(model: nn.Module) -> Callable[[], None]:
    """What the training step calls between backward and optimizer.step().

    Only our DDP needs it; torch DDP finishes its all-reduce inside backward.
    """
    if isinstance(model, DistributedDataParallel):
        return model.finish_gradient_sync
    return lambda: None
