"""A user's script with the commonest DDP mistake: one rank takes more batches than the others, no join().

    python tests/uneven_script.py EXTRA PEER_WAIT_S                      # under mnist_dist.parallel.spawn
    torchrun --nproc_per_node=2 tests/uneven_script.py EXTRA PEER_WAIT_S

Rank 1 runs EXTRA more steps than rank 0, which then waits in dist.barrier(); our DDP's backward on rank 1
waits for the other rank's share, which never comes."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.parallel import DistributedDataParallel, WorkerFailed, spawn


def worker(rank: int, world_size: int, extra: int, peer_wait_s: float) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2), peer_wait_s=peer_wait_s)
    for _ in range(3 + (extra if rank == 1 else 0)):
        model(torch.randn(8, 4)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    extra, peer_wait_s = int(sys.argv[1]), float(sys.argv[2])
    if "LOCAL_RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), extra, peer_wait_s)
    else:
        try:
            spawn(worker, 2, extra, peer_wait_s)
        except WorkerFailed as error:
            sys.exit(f"error: {error}")
