"""Our DistributedDataParallel and launcher in a script of your own, on a task that is not MNIST.

    python examples/ddp_regression.py

Fits a small MLP to y = sin(3·x·w) + noise (generated data, 8 features) on 2 CPU ranks with gloo,
and checks that it learned: the test MSE must fall below a tenth of the targets' variance; exits 1
otherwise. Of mnist_dist it imports only ``mnist_dist.parallel`` (``DistributedDataParallel`` and
``spawn``: processes, rendezvous, failure handling), itself files to copy; the model, data, sharding
and loop are this file's. The lines marked ``ADDED FOR DISTRIBUTED`` are what a one-process version
of this script would not have.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mnist_dist.parallel import DistributedDataParallel, WorkerFailed, spawn

WORLD_SIZE = 2
GLOBAL_BATCH = 64  # per optimizer step, over all ranks: the same training whatever WORLD_SIZE is
EPOCHS = 5
SEED = 0


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same generated data on every rank (a function of the seed); a real data set is prepared
    once, in the parent, before ``spawn``, and only opened by the ranks."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=generator) * 2 - 1
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(SEED))  # one target function
    return x, torch.sin(3 * x @ w / 8**0.5) + 0.05 * torch.randn(n, 1, generator=generator)


def worker(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)  # ADDED FOR DISTRIBUTED: one core per rank, not all of them each
    # ADDED FOR DISTRIBUTED: where spawn's ranks meet (a file; torchrun would set env://'s variables instead)
    dist.init_process_group("gloo", init_method=os.environ["MNIST_DIST_INIT_METHOD"], rank=rank, world_size=world_size)
    train_x, train_y = make_data(4096, seed=1)
    test_x, test_y = make_data(1000, seed=2)
    torch.manual_seed(SEED)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model = DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    for epoch in range(EPOCHS):
        # ADDED FOR DISTRIBUTED: one permutation per epoch, the same on every rank (a function of the
        # seed and the epoch, as DistributedSampler.set_epoch makes it), each rank its part of every
        # global batch; the last incomplete global batch is dropped, so every rank takes as many steps.
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(SEED * 100_003 + epoch))
        per_rank = GLOBAL_BATCH // world_size
        for start in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            indices = order[start + rank * per_rank : start + (rank + 1) * per_rank]
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(train_x[indices]), train_y[indices]).backward()  # averaged over the ranks on return
            optimizer.step()

    # ADDED FOR DISTRIBUTED: each rank scores a disjoint share of the test set and the sums are added,
    # so every test sample counts once (no padding duplicates).
    share = slice(len(test_x) * rank // world_size, len(test_x) * (rank + 1) // world_size)
    with torch.no_grad():
        totals = torch.stack(
            [
                F.mse_loss(model.module(test_x[share]), test_y[share], reduction="sum"),
                ((test_y[share] - test_y.mean()) ** 2).sum(),
            ]
        )
    dist.all_reduce(totals)
    mse, variance = (totals / len(test_x)).tolist()
    # The replicas must still be identical: the same averaged gradients, the same steps.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    identical = torch.tensor(float(torch.equal(weights, reference)))
    dist.all_reduce(identical, op=dist.ReduceOp.MIN)
    if rank == 0:  # ADDED FOR DISTRIBUTED: one rank reports
        print(f"test MSE {mse:.4f} (target variance {variance:.4f}), replicas identical: {bool(identical)}", flush=True)
        if mse > variance / 10 or not identical:
            raise RuntimeError(
                f"did not learn: test MSE {mse:.4f} is above {variance / 10:.4f}, or the replicas differ"
            )
    dist.barrier()  # ADDED FOR DISTRIBUTED: leave together: gloo may abort a rank whose peer left early
    dist.destroy_process_group()  # ADDED FOR DISTRIBUTED


if __name__ == "__main__":  # spawn starts fresh interpreters, which import this file without running this
    try:
        spawn(worker, WORLD_SIZE)
    except WorkerFailed as error:
        sys.exit(f"error: {error}")
    print("ok")
