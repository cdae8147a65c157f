"""The DataParallel family and the split model: same loss curve as single mode, plain checkpoints."""

import json

import pytest
import torch
from helpers import compose_config, scalars
from torch import nn

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.model import ConvNet
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.parallel.state import model_state
from mnist_dist.tools import write_idx

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VARIANTS = ["dp", "dp_block", "dp_functional", "split"]


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    """train/loss at each of 3 steps, and the final weights, per mode; dropout off. That a run learns:
    test_train.py."""
    out, root = {}, tmp_path_factory.mktemp("data")
    write_idx(root / "MNIST" / "raw", n_train=96, n_test=50)
    for mode in ["single", *VARIANTS]:
        run_dir = tmp_path_factory.mktemp(mode)
        launch(
            compose_config(root, f"mode={mode}", "epochs=1", "batch_size=32", "log_every=1", "model.dropout=false"),
            run_dir,
        )
        recorded = json.loads((run_dir / "results.json").read_text())["mode"]
        out[mode] = scalars(run_dir)["rank_0/train/loss"], torch.load(run_dir / "model.pt"), recorded
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", VARIANTS)
def test_variant_learns_the_same_curve_as_single(curves, mode):
    single, _, _ = curves["single"]
    losses, weights, recorded = curves[mode]
    assert recorded == mode  # the choice (dp_block), not the family (dp)
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-5, atol=1e-5)
    ConvNet().load_state_dict(weights)  # the checkpoint has the plain model's keys


def mode(name, **options):
    return MODES[name].schema(name=name, **options)


def test_dp_block_wraps_only_that_block_and_saves_plain_keys():
    model = wrap_model(ConvNet(), mode("dp_block", dp_block="features"), torch.device("cpu"))
    assert isinstance(model.features, nn.DataParallel) and not isinstance(model.classifier, nn.DataParallel)
    assert list(model_state(model)) == list(ConvNet().state_dict())  # what a checkpoint saves


def test_unknown_block_names_the_submodules():
    with pytest.raises(ConfigError, match="no submodule 'block2'; its submodules: features, classifier"):
        wrap_model(ConvNet(), mode("dp_block", dp_block="block2"), torch.device("cpu"))


@cuda
def test_functional_dp_equals_data_parallel_on_the_gpus():
    torch.manual_seed(0)
    net = ConvNet(dropout=False)
    x = torch.randn(64, 1, 28, 28)
    expected = net(x)
    gpus = torch.cuda.device_count()
    for name, options in (("dp", {}), ("dp_functional", {}), ("dp_block", {"dp_block": "features"})):
        replica = ConvNet(dropout=False)
        replica.load_state_dict(net.state_dict())
        model = wrap_model(replica, mode(name, **options), torch.device("cuda:0"), gpus)
        torch.testing.assert_close(model(x.cuda()).cpu(), expected, rtol=1e-4, atol=1e-4)


@cuda
def test_split_places_the_parts_and_moves_activations():
    gpus = min(torch.cuda.device_count(), 2)
    model = wrap_model(ConvNet(dropout=False), mode("split"), torch.device("cuda:0"), gpus)
    first, second = ("cuda:0", "cuda:1") if gpus == 2 else ("cpu", "cuda:0")
    assert next(model.features.parameters()).device == torch.device(first)
    assert next(model.classifier.parameters()).device == torch.device(second)
    assert model(torch.randn(8, 1, 28, 28)).device == torch.device(second)
