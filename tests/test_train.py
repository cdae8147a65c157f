"""The trainer end to end on tiny data: what a run writes. That every mode computes the same thing on any number of
ranks: test_world_size.py, test_dp.py."""

import json

import pytest
import torch
from helpers import compose_config, scalars

from mnist_dist.launch import launch
from mnist_dist.model import ConvNet
from mnist_dist.tools import write_idx

RANK_TAGS = {"train/loss", "perf/images_per_s"}  # written by rank 0 for every rank r as rank_<r>/<tag>
RUN_TAGS = {
    "train/loss_global",
    "perf/images_per_s_global",
    "train/lr",
    "perf/epoch_time_s",
    "test/loss",
    "test/accuracy",
    "time/train_s",  # training seconds at each evaluation: bench plots accuracy against it
}


def rank_tags(world_size: int) -> set[str]:
    return {f"rank_{r}/{tag}" for r in range(world_size) for tag in RANK_TAGS}


def run(tmp_path, n_train, *overrides):
    """A single run on ``n_train`` images (a run's time is mostly its images' passes): its directory and results."""
    root = write_idx(tmp_path / "data" / "MNIST" / "raw", n_train=n_train, n_test=100).parents[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch(compose_config(root, *overrides), run_dir)
    return run_dir, json.loads((run_dir / "results.json").read_text())


def test_single_run_learns_and_writes_everything(tmp_path):
    run_dir, results = run(tmp_path, 320, "epochs=3", "log_every=1", "warmup_steps=2")  # 5 steps an epoch
    assert results["mode"] == "single" and results["world_size"] == 1 and results["device"] == "cpu"
    assert (results["epochs"], results["batch_size"]) == (3, 64)
    assert results["test_accuracy"] >= 0.9 and results["train_images_per_s"] > 0
    assert results["wall_time_s"] > 0 and results["test_loss"] < 1.0
    tb = scalars(run_dir)
    assert set(tb) == RUN_TAGS | rank_tags(1)
    assert len(tb["rank_0/train/loss"]) == 15  # 3 epochs x 5 steps
    assert tb["rank_0/train/loss"][-1] < 0.5 * tb["rank_0/train/loss"][0]
    assert tb["rank_0/train/loss"] == tb["train/loss_global"]  # one rank: the global mean is its own
    assert tb["test/accuracy"][-1] == results["test_accuracy"]
    assert tb["train/lr"][0] == 1.0 and tb["train/lr"][-1] == pytest.approx(0.49)  # StepLR 0.7 twice
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert (checkpoint["epoch"], checkpoint["step"]) == (3, 15)
    final = torch.load(run_dir / "model.pt")
    assert all(torch.equal(final[k], checkpoint["model"][k]) for k in final)
    ConvNet().load_state_dict(final)  # no "module." prefix to strip
    assert "epoch 3: test loss" in (run_dir / "rank_0.log").read_text()
    assert "batch_size: 64" in (run_dir / "config.yaml").read_text()
