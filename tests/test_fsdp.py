"""mode=fsdp: FSDP2 computes what one process computes on the global batch, resumes bit for bit, writes
checkpoints the plain model loads, and holds less per rank the more ranks share the model."""

import json
import shutil

import pytest
import torch
from helpers import compose_config, scalars
from torch import nn

from mnist_dist.data import load_split, to_device_tensors
from mnist_dist.launch import launch
from mnist_dist.metrics import state_bytes
from mnist_dist.model import ConvNet, ResidualBlock, ResNet
from mnist_dist.parallel.fsdp import layer_groups, shard
from mnist_dist.parallel.state import model_state
from mnist_dist.step import evaluate

# 640 tiny images at a global batch of 30 (divisible by 2 and 3 ranks): 21 steps an epoch, dropout off.
# SGD with momentum: rounding stays at its own size (see test_train.py), and the optimizer has state
# to shard and to restore. 200 test images at 33 a batch: 3 ranks' shares of 66, 67, 67 take 2, 3, 3
# forwards, which would leave one rank out of fsdp's all-gathers without the trainer's empty ones.
STEPS = ("epochs=1", "batch_size=30", "model.dropout=false", "optim=sgd", "optim.lr=0.05", "optim.momentum=0.9")
STEPS += ("test_batch_size=33",)


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
    with pytest.raises(
        ValueError, match="group_classes: the model has no Block; its module classes are BatchNorm2d, Conv2d"
    ):
        layer_groups(resnet, ["Block"])


def test_state_bytes_counts_parameters_gradients_and_optimizer_state_once():
    model = nn.Linear(10, 10)  # 110 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert state_bytes(model, optimizer) == 110 * 4
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()
    assert state_bytes(model, optimizer) == 3 * 110 * 4  # weights, gradients, momentum


def test_bf16_knobs_compute_in_bf16_and_keep_fp32_shards(one_rank):
    model = shard(ConvNet(dropout=False), torch.device("cpu"), param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    seen = []
    model.classifier[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    logits = model(torch.randn(2, 1, 28, 28))
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32  # the loss is computed in fp32
    logits.sum().backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())  # what the optimizer steps
    assert list(model_state(model)) == list(ConvNet().state_dict())  # plain keys


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_root):
    """single and fsdp on 2 and 3 ranks for one epoch; the 2-rank run resumed for a second epoch, and
    the same two epochs uninterrupted. Weights after epoch 1 are kept as ``<name>/epoch1.pt``."""
    out = tmp_path_factory.mktemp("fsdp")

    def run(name, *overrides):
        (out / name).mkdir(exist_ok=True)
        launch(compose_config(tiny_root, *STEPS, "log_every=3", *overrides), out / name)
        return out / name

    for name, overrides in (("single", ()), ("fsdp2", ("mode=fsdp", "gpus=2")), ("fsdp3", ("mode=fsdp", "gpus=3"))):
        shutil.copy(run(name, *overrides) / "model.pt", out / name / "epoch1.pt")
    run("fsdp2", "mode=fsdp", "gpus=2", "epochs=2", f"resume={out / 'fsdp2'}")
    run("whole", "mode=fsdp", "gpus=2", "epochs=2")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp_equals_single_on_the_global_batch(runs, ranks):
    single = torch.load(runs / "single" / "epoch1.pt")
    sharded = torch.load(runs / f"fsdp{ranks}" / "epoch1.pt")
    assert sharded.keys() == single.keys()
    torch.manual_seed(1)  # the config's seed: the weights every mode starts from
    start = ConvNet(dropout=False).state_dict()
    assert (single["classifier.3.weight"] - start["classifier.3.weight"]).abs().max() > 1e-3  # it trained
    for name, value in sharded.items():
        torch.testing.assert_close(value, single[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp_resumes_bit_exactly_into_a_plain_checkpoint(runs):
    resumed, whole = (torch.load(runs / name / "model.pt") for name in ("fsdp2", "whole"))
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole), "resumed weights differ"
    assert scalars(runs / "fsdp2")["rank_0/train/loss"] == scalars(runs / "whole")["rank_0/train/loss"]
    saved = torch.load(runs / "whole" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 42 and set(saved["optimizer"]["state"]) == set(whole)  # full, by parameter name
    ConvNet().load_state_dict(whole)  # plain keys, full tensors


@pytest.mark.slow
def test_fsdp_evaluation_is_exact_and_scalars_are_per_rank(runs, tiny_root):
    results = json.loads((runs / "fsdp3" / "results.json").read_text())
    model = ConvNet(dropout=False)
    model.load_state_dict(torch.load(runs / "fsdp3" / "model.pt"))
    x, y = to_device_tensors(*load_split(tiny_root / "MNIST" / "raw", train=False), 0.1307, 0.3081, "cpu")
    loss, accuracy = evaluate(model, x, y, 1000, rank=0, world_size=1)
    assert (results["mode"], results["world_size"]) == ("fsdp", 3)
    assert results["test_accuracy"] == accuracy  # every test sample counted once, none twice
    assert results["test_loss"] == pytest.approx(loss, rel=1e-6)
    for rank in range(3):
        assert len(scalars(runs / "fsdp3")[f"rank_{rank}/train/loss"]) == 7  # 21 steps, every 3rd
    assert "test/accuracy" in scalars(runs / "fsdp3")


@pytest.mark.slow
def test_model_state_per_rank_falls_with_the_world_size(runs):
    per_rank = {
        name: json.loads((runs / name / "results.json").read_text())["model_state_mib"]
        for name in ("single", "fsdp2", "fsdp3")
    }
    weights = sum(v.numel() for v in ConvNet().state_dict().values()) * 4 / 2**20
    assert per_rank["single"] == [pytest.approx(3 * weights)]  # weights, gradients, momentum
    for ranks in (2, 3):  # a shard each, padded to a multiple of the world size per tensor
        assert all(3 * weights / ranks <= mib < 3 * weights / ranks * 1.01 for mib in per_rank[f"fsdp{ranks}"])
    assert per_rank["single"][0] > max(per_rank["fsdp2"]) > max(per_rank["fsdp3"])
