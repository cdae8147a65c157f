"""SIGTERM, SIGUSR1 or Ctrl-C while a run trains: noticed after every step, and at once before the first. (A job
whose log_every is above its steps stops with a checkpoint too: test_launch's srun job.)"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from mnist_dist.operations import preemption


def test_a_signal_is_acted_on_at_the_next_step_and_the_handlers_are_put_back(one_rank):
    before = signal.getsignal(signal.SIGTERM)
    with preemption.installed(60):
        assert preemption.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # noted, not acted on: a step is under way
        assert [preemption.requested() for _ in (2, 3)] == [None, "SIGUSR1"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_before_the_first_step_stops_at_once():
    before = "^stopped by SIGTERM before the first step: nothing new to save"
    with pytest.raises(preemption.Stopped, match=before), preemption.installed(60):
        os.kill(os.getpid(), signal.SIGTERM)


def _stops_together(rank: int, world_size: int):
    with preemption.installed(60):
        for step in range(1, 50):
            dist.all_reduce(torch.ones(1))  # the step's own collective
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)  # to this rank alone
            if stop := preemption.requested():
                return step, stop
    return None


def test_every_rank_stops_after_the_same_step_when_one_got_the_signal(tmp_path):
    assert run_ranks(_stops_together, 2, tmp_path) == [(6, "a signal to another rank"), (6, "SIGUSR1")]
