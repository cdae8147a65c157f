"""Data parallelism for any ``nn.Module``, usable from your own script: it imports nothing from the rest of
mnist_dist (examples/ddp_regression.py uses it). ``ddp.py`` imports only torch: copy it beside your script."""

from __future__ import annotations

# Before any process group exists: torch.distributed.nn.functional's collectives take group=group.WORLD
# as a default argument, evaluated at import. Imported after init_process_group (the first torch.optim
# optimizer imports it, through torch._dynamo), it holds the default group for good: destroy_process_group
# cannot free it, and gloo's threads live on into interpreter shutdown, where they can abort the process
# ("terminate called without an active exception"). Imported here, its defaults are None.
import torch.distributed.nn.functional  # noqa: F401

from mnist_dist.parallel.ddp_extras import DistributedDataParallel  # the core (ddp.py), join() and more
from mnist_dist.parallel.dp import FunctionalDataParallel, data_parallel, split
from mnist_dist.parallel.spawn import WorkerFailed, spawn
from mnist_dist.parallel.state import unwrap

__all__ = [
    "DistributedDataParallel",
    "FunctionalDataParallel",
    "data_parallel",
    "split",
    "unwrap",
    "spawn",
    "WorkerFailed",
]
