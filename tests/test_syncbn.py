"""Our SyncBatchNorm on gloo: N ranks normalise, learn and keep running statistics as one process does on the
concatenated batch, unequal shares included; in the trainer, a BatchNorm model's ddp run equals single."""

import pytest
import torch
import torch.distributed as dist
from helpers import compose_config, run_batch, scalars
from torch import nn

from mnist_dist.launch import launch
from mnist_dist.parallel.syncbn import convert_sync_batchnorm
from mnist_dist.tools import write_idx
from mnist_dist.tools.compare import compose_configs

SHARES = [4, 1, 6]  # images per rank: unequal on purpose


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    total = sum(SHARES)
    x = 3 * torch.randn(total, 4, 5, 5, generator=generator) + 1
    return x, torch.randn(total, 4, 5, 5, generator=generator)  # the upstream gradient, a weighted sum's


def layer() -> nn.Module:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
    return bn


def two_steps(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    for _ in range(2):  # two steps: the running statistics move twice
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x)
        (y * upstream).sum().backward()  # a sum over images: the ranks' losses add up to the global one
    return {
        "y": y.detach(),
        "grad_x": x.grad,
        "grad_weight": module.weight.grad,
        "grad_bias": module.bias.grad,
        "running": (module.running_mean.clone(), module.running_var.clone(), module.num_batches_tracked.clone()),
        "eval": module.eval()(x.detach()),
    }


def on_ranks(rank: int, world_size: int) -> dict:
    x, upstream = batch()
    start = sum(SHARES[:rank])
    share = slice(start, start + SHARES[rank])
    found = two_steps(convert_sync_batchnorm(nn.Sequential(layer()))[0], x[share], upstream[share])
    for key in ("grad_weight", "grad_bias"):  # this rank's own: the DDP wrapper adds them up (averages)
        dist.all_reduce(found[key])
    found["share"] = share
    return found


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_batch({"bn": (on_ranks,)}, len(SHARES), tmp_path_factory.mktemp("syncbn"))["bn"]


def test_ranks_compute_what_one_process_computes_on_the_whole_batch(ranks):
    expected = two_steps(layer(), *batch())
    alone = two_steps(convert_sync_batchnorm(nn.Sequential(layer()))[0], *batch())  # no process group
    for key in ("y", "grad_x", "grad_weight", "eval"):
        torch.testing.assert_close(alone[key], expected[key])  # a plain BatchNorm
    for found in ranks:
        share = found["share"]
        torch.testing.assert_close(found["y"], expected["y"][share], rtol=0, atol=1e-5)
        torch.testing.assert_close(found["grad_x"], expected["grad_x"][share], rtol=0, atol=1e-5)
        torch.testing.assert_close(found["eval"], expected["eval"][share], rtol=0, atol=1e-5)
        for key in ("grad_weight", "grad_bias"):
            torch.testing.assert_close(found[key], expected[key], rtol=0, atol=1e-4)
        for mine, single in zip(found["running"], expected["running"]):
            torch.testing.assert_close(mine, single, rtol=0, atol=1e-5)


STEPS = ("model=fastnet", "channels_last=false", "epochs=1", "batch_size=30", "log_every=1", "optim=sgd")


@pytest.mark.slow
def test_a_batchnorm_models_ddp_run_equals_single_with_sync_batchnorm(tmp_path):
    # torch_ddp converts the same way (test_models.py); 3 ranks' statistics: the test above
    root = write_idx(tmp_path / "data" / "MNIST" / "raw", n_train=180, n_test=50).parents[1]  # 6 steps
    curves = {}
    for name, overrides in (("single", ()), ("ddp", ("mode=ddp", "mode.sync_batchnorm=true", "gpus=2"))):
        (tmp_path / name).mkdir()
        launch(compose_config(root, *STEPS, *overrides), tmp_path / name)
        curves[name] = torch.tensor(scalars(tmp_path / name)["train/loss_global"])
    assert len(curves["single"]) == 6  # 180 images / 30
    torch.testing.assert_close(curves["ddp"], curves["single"], rtol=0, atol=1e-5)


def test_compare_synchronises_batchnorm_where_the_mode_can():
    configs = compose_configs(["single", "ddp", "torch_ddp"], ["recipe=fast"])
    assert [getattr(cfg.mode, "sync_batchnorm", None) for cfg, _ in configs.values()] == [None, True, True]
    convnet = compose_configs(["ddp"], [])  # no BatchNorm: nothing to synchronise
    assert convnet["ddp"][0].mode.sync_batchnorm is False
