"""Our DDP's CUDA-only paths, run on a CPU with the CUDA calls faked: its side stream on its parameters'
device rather than the current one (issue 37)."""

from contextlib import contextmanager

import torch
from torch import nn

from mnist_dist.parallel import DistributedDataParallel


class FakeStream:
    def __init__(self, device, log):
        self.device, self.log = device, log

    def wait_stream(self, other):
        self.log.append(("wait", self.device, other.device))


def test_our_ddp_syncs_the_streams_of_its_parameters_device_not_the_current_one(one_rank, monkeypatch):
    # A model on cuda:1 in a process whose current device is cuda:0 (no set_device(1)): the side stream
    # must wait for cuda:1's compute stream, and cuda:1's for it, or the write-back races the all-reduce.
    log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device, log))

    @contextmanager
    def on(stream):
        log.append(("on", stream.device))
        yield

    monkeypatch.setattr(torch.cuda, "stream", on)
    model = DistributedDataParallel(nn.Linear(4, 2))
    side = torch.device("cuda:1")
    model._device, model._stream = side, FakeStream(side, log)  # what __init__ builds on cuda:1
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    assert log and all(side in entry[1:] for entry in log), log
    assert [entry for entry in log if entry[0] == "wait"] == [("wait", side, side)] * 4  # launch and end, twice
    assert ("on", side) in log
