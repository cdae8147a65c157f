"""The backward counters both DDPs report (compute, communication, overlapped): they add up, on a scripted
clock, and a real 2-rank run reports them for both wrappers; torch DDP gets its bucket size."""

import types

import pytest
import torch
from helpers import run_batch
from torch import nn

from mnist_dist.metrics import ddp_counters_ms
from mnist_dist.model import ConvNet, FastNet
from mnist_dist.modes import DDPMode, TorchDDPMode, wrap_model
from mnist_dist.parallel import timing
from mnist_dist.parallel.timing import BackwardClock


@pytest.fixture
def clock(monkeypatch):
    """A BackwardClock on the CPU whose time is what the test says: ``clock.at(t, mark)``."""
    now = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now.t))
    backward = BackwardClock(torch.device("cpu"))

    def at(t: float, mark: str) -> None:
        now.t = t
        backward.mark(mark)

    backward.at = at
    return backward


def seconds(clock: BackwardClock) -> dict[str, float]:
    averages = clock.averages_ns()
    return {
        "compute": averages["avg_backward_compute_time"] / 1e9,
        "comm": averages["avg_backward_comm_time"] / 1e9,
        "overlap": averages["avg_backward_compute_comm_overlap_time"] / 1e9,
    }


# (seconds, mark) of one backward, as our DDP stamps them; the first stamp of a name counts, so a second
# bucket's comm_start changes nothing. Whole seconds: the nanosecond averages are exact.
OVERLAPPED = [(10, "compute_start"), (12, "comm_start"), (14, "comm_start"), (15, "compute_end"), (17, "comm_end")]
HIDDEN = [(10, "compute_start"), (11, "comm_start"), (15, "compute_end"), (15, "comm_end")]  # nothing left to wait
AT_THE_END = [(10, "compute_start"), (15, "compute_end"), (15, "comm_start"), (18, "comm_end")]  # overlap=False
# The first send 1 s after compute ended: that second is in neither counter (as in torch DDP's).
GAP = [(10, "compute_start"), (15, "compute_end"), (16, "comm_start"), (18, "comm_end")]


@pytest.mark.parametrize(
    "script, expected",
    [
        (OVERLAPPED, {"compute": 5, "comm": 5, "overlap": 3}),
        (HIDDEN, {"compute": 5, "comm": 4, "overlap": 4}),
        (AT_THE_END, {"compute": 5, "comm": 3, "overlap": 0}),
        (GAP, {"compute": 5, "comm": 2, "overlap": 0}),
    ],
)
def test_compute_plus_exposed_communication_is_the_backward_span(clock, script, expected):
    for t, mark in script:
        clock.at(t, mark)
    measured = seconds(clock)
    assert measured == expected
    exposed = measured["comm"] - measured["overlap"]
    stamps = {mark: t for t, mark in reversed(script)}  # the first of each
    gap = max(0, stamps["comm_start"] - stamps["compute_end"])
    span = stamps["comm_end"] - stamps["compute_start"]  # forward's end to the last bucket reduced
    assert measured["compute"] + exposed + gap == span
    assert 0 <= measured["overlap"] <= min(measured["compute"], measured["comm"])
    assert clock.last_wait_s() == exposed + gap  # what the trainer logs as time/comm_wait_ms


def test_averages_are_over_every_finished_backward_and_still_add_up(clock):
    for offset, script in ((0, OVERLAPPED), (100, AT_THE_END)):
        for t, mark in script:
            clock.at(offset + t, mark)
    clock.at(200, "compute_start")  # a forward whose backward has not run (or ran inside no_sync): not counted
    clock.at(201, "comm_start")
    measured = seconds(clock)
    assert measured == {"compute": 5, "comm": 4, "overlap": 1.5}
    assert measured["compute"] + measured["comm"] - measured["overlap"] == (7 + 8) / 2  # the mean span
    assert clock.last_wait_s() == 3  # the last finished backward's: AT_THE_END waited for all of its 3 s


def counters_of(rank: int, world_size: int, mode) -> tuple[dict[str, float], int]:
    """A few steps of the convnet wrapped as the trainer wraps it; the counters, torch's sampled iteration."""
    torch.manual_seed(rank)
    model = wrap_model(ConvNet(), mode, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(13):
        nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    logged = getattr(model, "_get_ddp_logging_data", dict)()  # torch's; ours keeps its counters in model.clock
    return ddp_counters_ms(model), logged.get("iteration", -1)


def torch_buckets(rank: int, world_size: int, bucket_cap_mb: float | None, net=ConvNet) -> list[int]:
    """torch DDP's buckets (bytes) after it rebuilt them in the order of the first backward: one all-reduce each."""
    model = wrap_model(net(), TorchDDPMode(bucket_cap_mb=bucket_cap_mb), torch.device("cpu"))
    for _ in range(3):
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    return [int(size) for size in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]


def our_buckets(rank: int, world_size: int, bucket_cap_mb: float | None, net) -> tuple[list[int], int]:
    """Our DDP's buckets (bytes) after three backwards, and the all-reduces its fourth backward issued."""
    model = wrap_model(net(), DDPMode(bucket_cap_mb=bucket_cap_mb), torch.device("cpu"))
    for _ in range(3):
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    sizes = dict(model.module.named_parameters())
    buckets = [sum(sizes[n].numel() * sizes[n].element_size() for n in bucket) for bucket in model.bucket_plan]
    calls, real = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    finally:
        torch.distributed.all_reduce = real
    return buckets, len(calls)


NETS, CAPS = (ConvNet, FastNet), (None, 25.0, 0.05)  # the app's two models; torch's default, one bucket, several


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    calls = {
        "torch_ddp": (counters_of, TorchDDPMode()),
        **{f"buckets {cap}": (torch_buckets, cap) for cap in (None, 25.0, 0.05)},
        **{f"torch {net.__name__} {cap}": (torch_buckets, cap, net) for net in NETS for cap in CAPS},
        **{f"ours {net.__name__} {cap}": (our_buckets, cap, net) for net in NETS for cap in CAPS},
    }
    return run_batch(calls, 2, tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("mode", ["torch_ddp"])
def test_both_ddps_report_counters_that_fit_together(ranks, mode):
    for counters, _ in ranks[mode]:
        assert set(counters) == {"backward_compute", "backward_comm", "backward_overlap"}
        assert counters["backward_compute"] > 0 and counters["backward_comm"] > 0
        assert 0 <= counters["backward_overlap"] <= counters["backward_comm"]
        assert counters["backward_overlap"] <= counters["backward_compute"]


def test_torch_ddp_on_cpu_samples_every_backward_as_ours_does(ranks):
    # The last sampled iteration (from 0) of 13: torch's default samples the first 10, then every 100th.
    assert [iteration for _, iteration in ranks["torch_ddp"]] == [12, 12]


def test_bucket_cap_mb_reaches_torch_ddp(ranks):
    # The convnet's gradients in bytes: fc1 and fc2 4,724,264, the convolutions 75,264. torch's default caps
    # the first bucket at 1 MiB (then 25); an explicit 25 caps every bucket, so one; 0.05 splits the convolutions.
    assert ranks["buckets None"][0] == [4_724_264, 75_264]
    assert ranks["buckets 25.0"][0] == [4_799_528]
    assert len(ranks["buckets 0.05"][0]) == 3 and ranks["buckets 0.05"][0] == ranks["buckets 0.05"][1]


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("net", NETS, ids=lambda net: net.__name__)
def test_both_ddps_cut_the_same_buckets_and_issue_as_many_all_reduces(ranks, net, cap):
    theirs = ranks[f"torch {net.__name__} {cap}"]
    for rank, (buckets, all_reduces) in enumerate(ranks[f"ours {net.__name__} {cap}"]):
        assert buckets == theirs[rank]  # the same bytes per bucket, in launch order
        assert all_reduces == len(theirs[rank])  # one all-reduce per bucket: as many collectives as torch
