"""The speed options (amp, channels_last, compile) work in every mode and change nothing they shouldn't."""

import pytest
import torch
from helpers import compose_config, scalars

from mnist_dist.launch import launch
from mnist_dist.step import Precision, train_step
from mnist_dist.tools import write_idx

STEPS = ("epochs=1", "batch_size=16", "log_every=1", "model.dropout=false")  # 20 steps of 320 images


@pytest.fixture(scope="module")
def make_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_idx(root / "MNIST" / "raw", n_train=320, n_test=50)
    return lambda *overrides: compose_config(root, *STEPS, *overrides)


def losses(make_config, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(make_config(*overrides), run_dir)
    return torch.tensor(scalars(run_dir)["train/loss_global"])  # the mean over ranks


@pytest.fixture(scope="module")
def fp32(make_config, tmp_path_factory):
    return losses(make_config, tmp_path_factory.mktemp("fp32"))


@pytest.mark.slow
def test_bf16_autocast_trains_like_fp32_around_our_ddps_hooks(make_config, tmp_path, fp32):
    # The trainer's step is the same in every mode; ddp adds the hooks that autocast must not disturb.
    bf16 = losses(make_config, tmp_path, "mode=ddp", "gpus=2", "amp=bf16")
    assert bf16[-1] < 0.5 * bf16[0]
    # bf16 keeps 8 bits of mantissa: the first loss (same weights) is fp32's to about 1 %, and then
    # Adadelta at lr 1.0 lets the two runs drift apart, as any change of rounding does.
    torch.testing.assert_close(bf16[0], fp32[0], rtol=0.02, atol=0.0)
    assert bf16[0] != fp32[0]


def test_fp16_scales_the_gradients_and_bf16_does_not():
    # fp16 convolutions on a CPU take a slow reference path, so this checks the step, not a run.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    after_backward = {}
    # after backward wrote it, before GradScaler.step unscaled it
    model[0].weight.register_post_accumulate_grad_hook(lambda p: after_backward.update(grad=p.grad.clone()))
    for amp, scale in (("fp16", 2.0**16), ("bf16", 1.0), ("off", 1.0)):  # 2**16: GradScaler's first scale
        precision = Precision(amp, torch.device("cpu"))
        first = train_step(model, optimizer, x, y, precision)
        # backward produced gradients times the scale; the optimizer stepped with them divided by it
        torch.testing.assert_close(after_backward["grad"], model[0].weight.grad * scale, msg=amp)
        for _ in range(20):
            loss = train_step(model, optimizer, x, y, precision)
        assert loss < first


@pytest.mark.slow
def test_compile_and_channels_last_compute_the_same_curve(make_config, tmp_path, fp32):
    # one run for both: either one off moves the curve (NHWC weights in our DDP's buckets: ddp_patterns.py)
    faster = losses(make_config, tmp_path, "compile=true", "channels_last=true")
    torch.testing.assert_close(faster, fp32, rtol=1e-4, atol=1e-5)
