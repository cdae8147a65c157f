"""Data parallelism for any ``nn.Module``, usable from your own script with nothing of MNIST or of this
app (it imports nothing from the rest of mnist_dist; see examples/ddp_regression.py)::

    from mnist_dist.parallel import DistributedDataParallel, spawn

    def worker(rank: int, world_size: int) -> None:
        dist.init_process_group("gloo")  # spawn set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
        model = DistributedDataParallel(MyNet())
        ...

    if __name__ == "__main__":
        spawn(worker, 2)

The app applies its modes with these in ``mnist_dist/modes.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.parallel.ddp import DistributedDataParallel
from mnist_dist.parallel.dp import FunctionalDataParallel, data_parallel, split
from mnist_dist.parallel.spawn import WorkerFailed, spawn

__all__ = [
    "DistributedDataParallel",
    "FunctionalDataParallel",
    "data_parallel",
    "split",
    "unwrap",
    "plain_state_dict",
    "compute_ends",
    "spawn",
    "WorkerFailed",
]

_WRAPPERS = (DistributedDataParallel, TorchDDP, nn.DataParallel, FunctionalDataParallel)


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
