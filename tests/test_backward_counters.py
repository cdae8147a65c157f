"""Both DDPs cut the same gradient buckets and issue one all-reduce each; torch DDP gets its bucket size
(torch's buckets read from its logging data, in this test only)."""

import pytest
import torch
from helpers import run_batch

from mnist_dist.model import ConvNet
from mnist_dist.modes import DDPMode, wrap_model

# spawned ranks: out of `-m "not slow"`, which keeps test_ddp.py's one job of our DDP against one process
pytestmark = pytest.mark.slow


def torch_buckets(rank: int, world_size: int, bucket_cap_mb: float | None) -> list[int]:
    """torch DDP's buckets (bytes) after it rebuilt them in the order of the first backward: one all-reduce each."""
    model = wrap_model(ConvNet(), DDPMode("torch_ddp", bucket_cap_mb=bucket_cap_mb), torch.device("cpu"))
    for _ in range(3):
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    return [int(size) for size in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]


def our_buckets(rank: int, world_size: int, bucket_cap_mb: float | None) -> tuple[list[int], int]:
    """Our DDP's buckets (bytes) after three backwards, and the all-reduces its fourth backward issued."""
    model = wrap_model(ConvNet(), DDPMode(bucket_cap_mb=bucket_cap_mb), torch.device("cpu"))
    for _ in range(3):
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    buckets = [bucket.buffer.numel() * bucket.buffer.element_size() for bucket in model._buckets]
    calls, real = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        model(torch.randn(2, 1, 28, 28)).sum().backward()
    finally:
        torch.distributed.all_reduce = real
    return buckets, len(calls)


CAPS = (None, 25.0, 0.05)  # torch's default, one bucket, several


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    calls = {
        **{f"torch {cap}": (torch_buckets, cap) for cap in CAPS},
        **{f"ours {cap}": (our_buckets, cap) for cap in CAPS},
    }
    return run_batch(calls, 2, tmp_path_factory.mktemp("ranks"))


def test_bucket_cap_mb_reaches_torch_ddp(ranks):
    # The convnet's gradients in bytes: fc1 and fc2 4,724,264, the convolutions 75,264. torch's default caps
    # the first bucket at 1 MiB (then 25); an explicit 25 caps every bucket, so one; 0.05 splits the convolutions.
    assert ranks["torch None"][0] == [4_724_264, 75_264]
    assert ranks["torch 25.0"][0] == [4_799_528]
    assert len(ranks["torch 0.05"][0]) == 3 and ranks["torch 0.05"][0] == ranks["torch 0.05"][1]


@pytest.mark.parametrize("cap", CAPS)
def test_both_ddps_cut_the_same_buckets_and_issue_as_many_all_reduces(ranks, cap):
    theirs = ranks[f"torch {cap}"]
    for rank, (buckets, all_reduces) in enumerate(ranks[f"ours {cap}"]):
        assert buckets == theirs[rank]  # the same bytes per bucket, in launch order
        assert all_reduces == len(theirs[rank])  # one all-reduce per bucket: as many collectives as torch
