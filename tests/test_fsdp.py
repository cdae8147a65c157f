"""mode=fsdp's layer groups. Its runs: test_world_size.py; its exact evaluation on uneven shares of the test set:
test_reported.py."""

import torch
from torch.distributed.fsdp import FSDPModule

from mnist_dist.model import ConvNet
from mnist_dist.parallel.fsdp import shard
from mnist_dist.parallel.state import model_state


def test_each_child_with_parameters_is_a_group_and_the_state_keeps_the_plain_keys(one_rank):
    model = shard(ConvNet(dropout=False), torch.device("cpu"))
    groups = [model, model.features, model.classifier, model.features[0]]
    assert [isinstance(m, FSDPModule) for m in groups] == [True, True, True, False]
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    assert list(model_state(model)) == list(ConvNet().state_dict())
