"""Ranks that run different numbers of steps without join(): our DDP's backward waits for the other ranks'
share no longer than the process group's timeout (dist.timeout_s in the app), and the job ends in one line
naming the likely cause."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.parallel import DistributedDataParallel, WorkerFailed, spawn

TIMEOUT_S = 2  # the process group's: the app's default minute would be most of this file's time


def _one_extra_step(rank: int, world_size: int) -> None:
    """The commonest DDP mistake: rank 1 takes one batch more, and rank 0 waits in barrier()."""
    init = os.environ["MNIST_DIST_INIT_METHOD"]  # spawn's store
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S)
    )
    model = DistributedDataParallel(nn.Linear(4, 2))
    for _ in range(3 + rank):
        model(torch.randn(8, 4)).sum().backward()
    dist.barrier()


@pytest.mark.slow
def test_an_extra_step_on_one_rank_ends_by_the_process_groups_timeout_in_one_line():
    # Either rank may be named: the one that timed out, or its peer that saw it end (test_spawn)
    cause = r"^rank [01] failed: .*([Tt]imed out|closed by peer).*dist.timeout_s.*join\(\)"
    with pytest.raises(WorkerFailed, match=cause) as error:
        spawn(_one_extra_step, 2, start_method="forkserver")
    assert "\n" not in str(error.value)
