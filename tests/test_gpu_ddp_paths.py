"""Our DDP's CUDA-only paths, run on a CPU with the CUDA calls faked: its backward clock on CUDA events, and
its side stream on its parameters' device rather than the current one (issue 37)."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from mnist_dist.parallel import DistributedDataParallel
from mnist_dist.parallel.timing import BackwardClock


class FakeEvent:
    """torch.cuda.Event: ``record()`` stamps the next time of ``TIMES`` (ms); elapsed_time reads them."""

    TIMES: list[float] = []
    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.ms = None

    def record(self, stream=None):
        self.ms = FakeEvent.TIMES.pop(0)
        FakeEvent.recorded += 1

    def synchronize(self):
        assert self.ms is not None, "read before it was recorded"

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_our_ddp_times_its_backward_with_cuda_events(one_rank, monkeypatch):
    # The clock's CUDA path (events on the compute stream, read after the step) ran in no test.
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr("time.perf_counter", lambda: pytest.fail("a host clock read: each stamp must be an event"))
    FakeEvent.TIMES, FakeEvent.recorded = [0.0, 2.0, 10.0, 13.0, 20.0, 21.0, 30.0, 31.0], 0
    model = DistributedDataParallel(nn.Linear(4, 2))
    model.clock = BackwardClock(torch.device("cuda:0"))  # as modes.py attaches it, on a GPU
    for _ in range(2):  # the first backward records the plan, the second runs on it: both are stamped
        model(torch.randn(3, 4)).sum().backward()
    assert FakeEvent.recorded == 8  # compute start, comm start, compute end, comm end, twice
    assert model.clock.last_wait_s() == pytest.approx(0.001)  # the second: 31 - 30 ms
    # torch DDP's three averages, in ns: compute (10 + 10) / 2, comm (11 + 10) / 2, overlap (8 + 9) / 2
    assert model.clock.averages_ns() == pytest.approx(
        {
            "avg_backward_compute_time": 10_000_000,
            "avg_backward_comm_time": 10_500_000,
            "avg_backward_compute_comm_overlap_time": 8_500_000,
        },
        abs=1,  # int() of a float sum
    )
    model.clock.enabled = False  # the step timer's unsampled steps record nothing
    model(torch.randn(3, 4)).sum().backward()
    assert FakeEvent.recorded == 8


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
