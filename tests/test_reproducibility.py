"""Exact resume, at an epoch's end and mid-epoch. Under ddp: test_world_size.py (at any number of ranks) and
test_launch.py."""

import pytest
import torch
from helpers import compose_config, scalars

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.tools import write_idx

# 2 epochs of 10 steps (320 images), a checkpoint every 5 steps: saved at 5, 10 (epoch end), 15, 20; the 2 kept
# are 20 and 15. Dropout stays on: resuming must restore the random state too.
SHORT = (
    "epochs=2",
    "batch_size=32",
    "log_every=1",
    "checkpoint_every_steps=5",
    "model._target_=failing_model.NarrowConvNet",
)


@pytest.fixture(scope="module")
def make_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_idx(root / "MNIST" / "raw", n_train=320, n_test=50)
    return lambda *overrides: compose_config(root, *overrides)


def run(make_config, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(make_config(*SHORT, *overrides), run_dir)
    return torch.load(run_dir / "model.pt"), scalars(run_dir)


@pytest.fixture(scope="module")
def whole(make_config, tmp_path_factory):
    """The uninterrupted run: its directory, weights and scalars."""
    run_dir = tmp_path_factory.mktemp("whole")
    return (run_dir, *run(make_config, run_dir))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ"


def test_checkpoint_carries_the_fp16_loss_scale(make_config, tmp_path):
    tiny = ("model._target_=helpers.TinyMLP", "~model.dropout")
    run(make_config, tmp_path, "amp=fp16", "epochs=1", "batch_size=160", *tiny)
    scaler = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["scaler"]
    assert scaler["scale"] > 1 and scaler["_growth_tracker"] == 2  # two steps without an overflow


@pytest.mark.slow
def test_resume_at_an_epochs_end_and_mid_epoch_equals_uninterrupted(make_config, whole, tmp_path):
    whole_dir, whole_weights, whole_scalars = whole
    assert sorted(p.name for p in whole_dir.glob("checkpoint*")) == ["checkpoint.1.pt", "checkpoint.pt"]
    part, elsewhere = tmp_path / "part", tmp_path / "unused"
    run(make_config, part, "epochs=1")
    launch(make_config(*SHORT, f"resume={part}"), elsewhere, SHORT)  # from the end of epoch 1
    assert_same_weights(torch.load(part / "model.pt"), whole_weights)
    # As if it crashed in epoch 2 after logging step 20: TensorBoard holds steps the checkpoint (step 15) has not
    # done. Resuming must log them once, dropout masks and all.
    state = checkpoint.load(part / "checkpoint.1.pt")
    assert (state["epoch"], state["epoch_step"], state["step"]) == (1, 5, 15)
    (part / "checkpoint.pt").write_bytes((part / "checkpoint.1.pt").read_bytes())
    launch(make_config(*SHORT, f"resume={part}/checkpoint.pt"), elsewhere, SHORT)
    assert not elsewhere.exists()  # resumed runs go on in their own directory
    assert_same_weights(torch.load(part / "model.pt"), whole_weights)
    resumed = scalars(part)
    assert resumed["rank_0/train/loss"] == whole_scalars["rank_0/train/loss"]  # 20 steps, none twice, same values
    assert resumed["test/accuracy"] == whole_scalars["test/accuracy"]


def test_a_missing_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint there"):
        checkpoint.locate(str(tmp_path / "old"))
