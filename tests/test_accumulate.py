"""Gradient accumulation: k micro-batches per optimizer step, all-reduced only after the last."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import compose_config, run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.launch import launch
from mnist_dist.model import ConvNet
from mnist_dist.parallel import DistributedDataParallel, unwrap
from mnist_dist.step import Precision, train_step
from mnist_dist.tools import write_idx

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
    single = _train(copy.deepcopy(start), zip(x, y), 1)  # the whole global batch in one pass
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
    assert (single["classifier.3.weight"] - start["classifier.3.weight"]).abs().max() > 1e-3
    for name, value in ours_2.items():
        # single k=1 vs 2 ranks x k=2: the cross-mode tolerance of test_train.py
        torch.testing.assert_close(value, single[name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(value, ours_1[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_accumulate_in_single_mode_equals_one_pass(tmp_path):
    root = write_idx(tmp_path / "data" / "MNIST" / "raw", n_train=128, n_test=20).parents[1]  # 2 steps
    weights = {}
    for k in (1, 2):
        cfg = compose_config(root, "epochs=1", "batch_size=64", "model.dropout=false", "optim=sgd", f"accumulate={k}")
        (tmp_path / str(k)).mkdir()
        launch(cfg, tmp_path / str(k))
        weights[k] = torch.load(tmp_path / str(k) / "model.pt")
    for name, value in weights[2].items():
        torch.testing.assert_close(value, weights[1][name], rtol=1e-5, atol=1e-6, msg=name)
