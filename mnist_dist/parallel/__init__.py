"""Applying a mode to a plain model (the one place where distribution enters the model), and starting
the processes that run it.

Usable from your own script, with nothing of MNIST (see examples/ddp_regression.py)::

    from mnist_dist.parallel import DistributedDataParallel, spawn

    def worker(rank: int, world_size: int) -> None:
        dist.init_process_group("gloo")  # spawn set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
        model = DistributedDataParallel(MyNet())
        ...

    if __name__ == "__main__":
        spawn(worker, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.config import DISTRIBUTED_MODES, ModeConfig
from mnist_dist.parallel.ddp import DistributedDataParallel
from mnist_dist.parallel.dp import FunctionalDataParallel, data_parallel, split
from mnist_dist.parallel.spawn import WorkerFailed, spawn

__all__ = [
    "DistributedDataParallel",
    "wrap_model",
    "unwrap",
    "plain_state_dict",
    "compute_ends",
    "spawn",
    "WorkerFailed",
]

_WRAPPERS = (DistributedDataParallel, TorchDDP, nn.DataParallel, FunctionalDataParallel)


def wrap_model(model: nn.Module, mode: ModeConfig, device: torch.device, gpus: int = 1) -> nn.Module:
    """Places ``model`` and wraps it for ``mode``; the process group must exist for ddp modes.

    ``device`` is this process's device (cuda:<local rank> or cpu); dp and split use ``gpus`` devices.
    """
    if mode.name == "split":
        first, second = (
            ("cuda:0", "cuda:1") if device.type == "cuda" and gpus > 1 else ("cpu", device)
        )  # one GPU: the tutorial's CPU + GPU example; no GPU: both on the CPU
        return split(model, mode.split_at, torch.device(first), torch.device(second))
    model = model.to(device)
    if mode.sync_batchnorm and mode.name in DISTRIBUTED_MODES:
        # Before wrapping, so that the wrapper registers the converted layers (same parameters).
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if mode.name == "dp":
        device_ids = list(range(gpus)) if device.type == "cuda" else []  # [] : a pass-through on CPU
        return data_parallel(model, device_ids, mode.dp_block, mode.dp_functional)
    if mode.name == "ddp":
        return DistributedDataParallel(
            model,
            message_size=mode.message_size,
            overlap=mode.overlap,
            find_unused_parameters=mode.find_unused_parameters,
            compress_bf16=mode.compress_bf16,
        )
    if mode.name == "torch_ddp":
        return TorchDDP(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=mode.find_unused_parameters,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an outer wrapper, for evaluation without wrapper machinery."""
    return model.module if isinstance(model, _WRAPPERS) else model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict the plain model would have: no ``module.`` from a wrapper, outer or inner
    (dp_block wraps a submodule), so checkpoints load into the bare model class."""
    model = unwrap(model)
    inner = [f"{name}." for name, m in model.named_modules() if name and isinstance(m, _WRAPPERS)]
    state = {}
    for key, value in model.state_dict().items():
        for prefix in inner:
            if key.startswith(prefix + "module."):
                key = prefix + key[len(prefix + "module.") :]
        state[key] = value
    return state


@contextmanager
def compute_ends(model: nn.Module, done: Callable[[], None]) -> Iterator[None]:
    """Around ``backward()``: calls ``done`` once when this rank's compute ends, so that the time after
    it is the communication that backward did not hide.

    Our DDP waits for its all-reduces at the end of backward and calls ``done`` just before; for
    every other model ``done`` runs when the block ends (torch DDP's wait stays inside backward).
    """
    called = []

    def once() -> None:
        called.append(True)
        done()

    ours = model if isinstance(model, DistributedDataParallel) else None
    if ours is not None:
        ours.before_comm_wait = once
    try:
        yield
    finally:
        if ours is not None:
            ours.before_comm_wait = None
    if not called:
        done()
