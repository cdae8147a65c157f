"""Gradient accumulation: k micro-batches per optimizer step, all-reduced only after the last."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.model import ConvNet
from mnist_dist.parallel import DistributedDataParallel, unwrap
from mnist_dist.step import Precision, train_step

STEPS, GLOBAL_BATCH = 3, 32


def _train(model, batches, accumulate):
    """``model`` after one SGD step per (x, y) of ``batches``, each as ``accumulate`` micro-batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    precision = Precision("off", torch.device("cpu"))
    for x, y in batches:
        train_step(model, optimizer, x, y, precision, accumulate)
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}


def _collectives_of(fn):
    """``fn()``'s result and how many all-reduces it issued."""
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        return fn(), len(calls)
    finally:
        dist.all_reduce = real


def _accumulation_three_ways(rank, world_size):
    torch.manual_seed(0)
    x, y = torch.randn(STEPS, GLOBAL_BATCH, 1, 28, 28), torch.randint(0, 10, (STEPS, GLOBAL_BATCH))
    share = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    mine = [(xb[share], yb[share]) for xb, yb in zip(x, y)]
    torch.manual_seed(1)
    start = ConvNet(dropout=False)
    single = {k: _train(copy.deepcopy(start), zip(x, y), k) for k in (1, 2)}  # the whole global batch, one process
    ours = {}
    for k in (1, 2):
        model = DistributedDataParallel(copy.deepcopy(start), bucket_cap_mb=0.05)  # several buckets
        ours[k] = _collectives_of(lambda: _train(model, mine, k))  # noqa: B023 (called at once)
    theirs = _train(TorchDDP(copy.deepcopy(start)), mine, 2)
    return start.state_dict(), single, ours, theirs


@pytest.mark.slow
def test_accumulation_equals_one_big_batch_and_torch_ddp(tmp_path):
    (start, single, ours, theirs), _ = run_ranks(_accumulation_three_ways, 2, tmp_path)
    (ours_1, reduces_1), (ours_2, reduces_2) = ours[1], ours[2]
    assert reduces_2 == reduces_1 > 0  # no_sync: the first micro-batch's backward all-reduced nothing
    assert (single[1]["classifier.3.weight"] - start["classifier.3.weight"]).abs().max() > 1e-3
    for name, value in ours_2.items():
        # single k=1 vs 2 ranks x k=2: the cross-mode tolerance of test_train.py
        torch.testing.assert_close(value, single[1][name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(single[2][name], single[1][name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(value, ours_1[name], rtol=1e-5, atol=1e-5, msg=name)
