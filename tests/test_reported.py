"""What a run reports is what it saved: results.json's test accuracy and loss are model.pt's, evaluated in
one process, in every mode, for a BatchNorm model whose ranks would otherwise each hold running
statistics of their own; every test sample counted once, none twice, on uneven shares too."""

import json

import pytest
import torch
from helpers import compose_config
from hydra.utils import instantiate

from mnist_dist.data import load_split, raw_dir, to_device_tensors
from mnist_dist.launch import launch
from mnist_dist.step import evaluate_as_saved
from mnist_dist.tools import write_idx

BATCHNORM = ("model=fastnet", "epochs=1", "batch_size=48", "optim=sgd", "optim.lr=0.05")
RUNS = {
    "single": (),
    "torch_ddp3": ("mode=torch_ddp", "gpus=3"),
    # 200 test images at 33 a batch: 3 ranks' shares of 66, 67, 67 take 2, 3, 3 forwards, which would leave one
    # rank out of fsdp's all-gathers without the trainer's empty ones
    "fsdp3": ("mode=fsdp", "gpus=3", "test_batch_size=33"),
    # 3 steps: OneCycleLR cannot warm up over exactly one step (0.25 x 4 steps; torch divides by zero)
    "fsdp2_fast": ("mode=fsdp", "gpus=2", "recipe=fast", "batch_size=64"),  # channels_last: once a crash
    # fsdp keeps the weights contiguous (fully_shard requires it) and only the activations NHWC
    "ddp2_fast": ("mode=ddp", "gpus=2", "recipe=fast", "batch_size=64", "channels_last=false"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data.root of 4 training steps (a run's time is mostly its images) and the usual 200 test images."""
    data = tmp_path_factory.mktemp("data")
    write_idx(data / "MNIST" / "raw", n_train=192, n_test=200)
    return data


@pytest.fixture(scope="module")
def runs(root, tmp_path_factory):
    out = tmp_path_factory.mktemp("reported")
    for name, overrides in RUNS.items():
        (out / name).mkdir()
        launch(compose_config(root, *BATCHNORM, *overrides), out / name)
    return out


def evaluated_in_one_process(root, run_dir) -> tuple[float, float]:
    cfg = compose_config(root, *BATCHNORM)
    model = instantiate(cfg.model)
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    x, y = to_device_tensors(*load_split(raw_dir("mnist", root), train=False), 0.1307, 0.3081, "cpu")
    assert (cfg.data.mean, cfg.data.std) == (0.1307, 0.3081)
    return evaluate_as_saved(model, x, y, 1000, 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_the_reported_accuracy_is_the_saved_models(root, runs, name):
    results = json.loads((runs / name / "results.json").read_text())
    loss, accuracy = evaluated_in_one_process(root, runs / name)
    assert results["test_accuracy"] == accuracy
    assert results["test_loss"] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_fsdp_trains_the_fast_recipe_as_ddp_does(runs):
    fsdp, ddp = (json.loads((runs / name / "results.json").read_text()) for name in ("fsdp2_fast", "ddp2_fast"))
    assert fsdp["test_loss"] == pytest.approx(ddp["test_loss"], abs=1e-5)
    fsdp_state, ddp_state = (torch.load(runs / name / "model.pt") for name in ("fsdp2_fast", "ddp2_fast"))
    for key, value in ddp_state.items():
        torch.testing.assert_close(fsdp_state[key], value, rtol=0, atol=1e-5, msg=key)
