"""Both DDPs cut the same gradient buckets and issue one all-reduce each; torch DDP gets its bucket size
(torch's buckets read from its logging data, in this test only)."""

import pytest
import torch
from helpers import run_batch

from mnist_dist.model import ConvNet, FastNet
from mnist_dist.modes import DDPMode, TorchDDPMode, wrap_model

# spawned ranks: out of `-m "not slow"`, which keeps test_ddp.py's one job of our DDP against one process
pytestmark = pytest.mark.slow


def torch_buckets(rank: int, world_size: int, bucket_cap_mb: float | None, net) -> list[int]:
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
        **{f"torch {net.__name__} {cap}": (torch_buckets, cap, net) for net in NETS for cap in CAPS},
        **{f"ours {net.__name__} {cap}": (our_buckets, cap, net) for net in NETS for cap in CAPS},
    }
    return run_batch(calls, 2, tmp_path_factory.mktemp("ranks"))


def test_bucket_cap_mb_reaches_torch_ddp(ranks):
    # The convnet's gradients in bytes: fc1 and fc2 4,724,264, the convolutions 75,264. torch's default caps
    # the first bucket at 1 MiB (then 25); an explicit 25 caps every bucket, so one; 0.05 splits the convolutions.
    assert ranks["torch ConvNet None"][0] == [4_724_264, 75_264]
    assert ranks["torch ConvNet 25.0"][0] == [4_799_528]
    assert len(ranks["torch ConvNet 0.05"][0]) == 3 and ranks["torch ConvNet 0.05"][0] == ranks["torch ConvNet 0.05"][1]


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("net", NETS, ids=lambda net: net.__name__)
def test_both_ddps_cut_the_same_buckets_and_issue_as_many_all_reduces(ranks, net, cap):
    theirs = ranks[f"torch {net.__name__} {cap}"]
    for rank, (buckets, all_reduces) in enumerate(ranks[f"ours {net.__name__} {cap}"]):
        assert buckets == theirs[rank]  # the same bytes per bucket, in launch order
        assert all_reduces == len(theirs[rank])  # one all-reduce per bucket: as many collectives as torch
