"""Reproducibility as a tested property: repeatable runs, exact resume (at an epoch's end and mid-epoch), the
compare command's arithmetic. Under ddp: test_world_size.py (at any number of ranks) and test_launch.py."""

import pytest
import torch
from helpers import compose_config, scalars

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.tools import write_idx
from mnist_dist.tools.compare import compare

# 2 epochs of 10 steps (320 images), a checkpoint every 5 steps: saved at 5, 10 (epoch end), 15, 20; the 2 kept
# are 20 and 15. Dropout stays on: resuming must restore the random state too.
SHORT = ("epochs=2", "batch_size=32", "log_every=1", "checkpoint_every_steps=5")


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


class TinyMLP(torch.nn.Sequential):
    """fp16 convolutions take a slow reference path on a CPU: an MLP keeps the fp16 run short."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def test_checkpoint_carries_the_fp16_loss_scale(make_config, tmp_path):
    tiny = ("model._target_=test_reproducibility.TinyMLP", "~model.dropout")
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


def test_compare_verdict_and_arithmetic():
    results = {
        m: {"world_size": w, "test_accuracy": 0.9, "train_images_per_s": s}
        for m, w, s in (("single", 1, 100.0), ("ddp", 2, 150.0))
    }
    curves = {"single": {10: 1.0, 20: 0.5}, "ddp": {10: 1.00001, 20: 0.53}}
    report = compare(results, curves, tolerance=0.02, early_tolerance=1e-4)
    assert report["first_step"] == 10
    assert [row["first_step_loss_diff"] for row in report["rows"]] == [0.0, pytest.approx(1e-5)]
    assert [row["max_loss_diff"] for row in report["rows"]] == [0.0, pytest.approx(0.03)]
    assert [row["final_loss"] for row in report["rows"]] == [0.5, 0.53]
    assert not report["agree"] and report["verdict"].startswith("MODES DISAGREE")
    assert compare(results, curves, tolerance=0.05, early_tolerance=1e-4)["agree"]
    assert not compare(results, curves, tolerance=0.05, early_tolerance=1e-6)["agree"]
