"""SIGTERM, SIGUSR1 or Ctrl-C while a run trains: noticed after every step, and at once before the first. (A job
whose log_every is above its steps stops with a checkpoint too: test_launch's srun job.)"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from mnist_dist.operations import preemption


def test_a_signal_is_acted_on_at_the_next_step_and_the_handlers_are_put_back(one_rank):
    before = signal.getsignal(signal.SIGTERM)
    with preemption.installed(60):
        assert preemption.requested(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # noted, not acted on: a step is under way
        assert [preemption.requested(step) for step in (2, 3)] == [None, "SIGUSR1"]
    assert signal.getsignal(signal.SIGTERM) is before and preemption.received() == signal.SIGUSR1


def test_a_signal_before_the_first_step_stops_at_once():
    before = "^stopped by SIGTERM before the first step: nothing new to save"
    with pytest.raises(preemption.Stopped, match=before), preemption.installed(60):
        os.kill(os.getpid(), signal.SIGTERM)


# A task that waits in a rendezvous for a peer that never comes (its store on 127.0.0.1 only); Stopped
# reported as mnist_dist/__main__.py does, for a signal that lands while Python code runs.
BLOCKED = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
from mnist_dist.operations import preemption
stopping = preemption.installed(60)
stopping.__enter__()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=90), master_listen_fd=listener.detach())
try:
    print("waiting", flush=True)
    store.wait(["a peer that never comes"])
except preemption.Stopped as stop:  # the signal came before the wait (it is meant to come during it)
    sys.stderr.write(f"{stop}\\n")
    sys.exit(preemption.REQUEUE)
"""


def test_a_signal_during_the_rendezvous_exits_for_a_requeue(tmp_path):
    task = subprocess.Popen([sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert task.stdout.readline() == "waiting\n"
        time.sleep(0.5)  # into the wait, whose C++ no Python handler interrupts
        task.send_signal(signal.SIGTERM)
        _, err = task.communicate(timeout=120)  # the rendezvous would time out after 90 s
    finally:
        task.kill()
        task.wait()
    assert task.returncode == preemption.REQUEUE, err
    assert err.splitlines()[-1].startswith("stopped by SIGTERM before the first step: nothing new to save")


def _stops_together(rank: int, world_size: int):
    with preemption.installed(60):
        for step in range(1, 50):
            dist.all_reduce(torch.ones(1))  # the step's own collective
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)  # to this rank alone
            if stop := preemption.requested(step):
                return step, stop
    return None


def test_every_rank_stops_after_the_same_step_when_one_got_the_signal(tmp_path):
    assert run_ranks(_stops_together, 2, tmp_path) == [(6, "a signal to another rank"), (6, "SIGUSR1")]
