"""Data order: identical global batches in every mode, disjoint shares, exact evaluation split; the saved model."""

import pytest
import torch

from mnist_dist.data import epoch_order, eval_shard, rank_batches
from mnist_dist.model import ConvNet
from mnist_dist.parallel.state import model_state


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_split_each_single_mode_batch_disjointly(world_size):
    order = epoch_order(1000, seed=7, epoch=2)
    single = list(rank_batches(order, 96, rank=0, world_size=1))
    shares = [list(rank_batches(order, 96, rank, world_size)) for rank in range(world_size)]
    assert len(single) == 1000 // 96 and all(len(s) == len(single) for s in shares)
    for step, batch in enumerate(single):
        parts = [share[step] for share in shares]
        assert all(len(p) == 96 // world_size for p in parts)
        assert torch.equal(torch.cat(parts), batch)  # same samples, same order as single mode


def test_order_is_reshuffled_each_epoch_and_reproducible():
    assert torch.equal(epoch_order(500, 1, 1), epoch_order(500, 1, 1))
    assert not torch.equal(epoch_order(500, 1, 1), epoch_order(500, 1, 2))
    assert not torch.equal(epoch_order(500, 1, 1), epoch_order(500, 2, 1))
    assert sorted(epoch_order(500, 1, 1).tolist()) == list(range(500))


@pytest.mark.parametrize("n, world_size", [(10_000, 3), (7, 4), (3, 4)])
def test_eval_shards_cover_every_sample_once(n, world_size):
    covered = [i for rank in range(world_size) for i in range(n)[eval_shard(n, rank, world_size)]]
    assert covered == list(range(n))


def test_the_saved_model_is_a_snapshot_on_the_cpu():
    # model.pt must load where no GPU is (before: the tensors of the device they trained on, cuda:1 after split)
    model = ConvNet()
    state = model_state(model)
    assert all(tensor.device.type == "cpu" for tensor in state.values())
    live = {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}
    assert not live & {tensor.untyped_storage().data_ptr() for tensor in state.values()}  # copied off the device
