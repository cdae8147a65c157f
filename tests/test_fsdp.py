"""mode=fsdp's parts: the layer groups it shards, its bf16 knobs. Its runs: test_world_size.py; its exact evaluation
on uneven shares of the test set: test_reported.py; the state it counts: test_gpu_paths.py."""

import pytest
import torch
from torch import nn

from mnist_dist.model import ConvNet, ResidualBlock, ResNet
from mnist_dist.parallel.fsdp import layer_groups, shard
from mnist_dist.parallel.state import model_state


def test_layer_groups_are_the_children_with_parameters_or_the_named_classes():
    convnet, resnet = ConvNet(), ResNet()
    assert layer_groups(convnet, []) == [convnet.features, convnet.classifier]
    assert layer_groups(resnet, []) == [resnet.features, resnet.classifier]
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    assert layer_groups(mlp, []) == [mlp[1], mlp[3]]
    blocks = layer_groups(resnet, ["ResidualBlock", "Linear"])
    assert [type(m).__name__ for m in blocks] == ["Linear", "ResidualBlock", "ResidualBlock", "ResidualBlock"]
    assert blocks[1] is resnet.features[5]  # innermost (last) first: fully_shard goes inside out
    assert all(isinstance(b, ResidualBlock) for b in blocks[1:])
    with pytest.raises(ValueError, match="group_classes: the model has no Block; .*BatchNorm2d, Conv2d"):
        layer_groups(resnet, ["Block"])


def test_bf16_knobs_compute_in_bf16_and_keep_fp32_shards(one_rank):
    model = shard(ConvNet(dropout=False), torch.device("cpu"), param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    seen = []
    model.classifier[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    logits = model(torch.randn(2, 1, 28, 28))
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32  # the loss is computed in fp32
    logits.sum().backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())  # what the optimizer steps
    assert list(model_state(model)) == list(ConvNet().state_dict())  # plain keys
