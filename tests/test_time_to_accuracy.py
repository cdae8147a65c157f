"""Time to accuracy: an exact evaluation every eval_every_steps, a stop at target_accuracy, and the fast recipe
(what it reaches on Fashion-MNIST: the README's first command, tests/test_readme.py)."""

import json
import re

import pytest
import torch
from helpers import scalars, validate_here

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.tools import bench, read_scalars


@pytest.mark.slow  # ranks in fresh processes
def test_training_stops_at_the_first_evaluation_that_reaches_the_target(make_config, tmp_path):
    # Tiny data: 10 steps per epoch; the target is low enough that the 4th step's model reaches it. In ddp: every
    # rank stops at that step (the evaluation is a collective), or the job hangs.
    tiny = ("epochs=3", "batch_size=64", "model._target_=helpers.TinyMLP", "~model.dropout")
    launch(make_config(*tiny, "mode=ddp", "gpus=2", "target_accuracy=0.3", "eval_every_steps=4"), tmp_path)
    reached = json.loads((tmp_path / "results.json").read_text())
    tb = read_scalars(tmp_path)
    evaluated = list(tb["test/accuracy"].items())
    first = next(step for step, accuracy in evaluated if accuracy >= 0.3)
    assert reached["steps_to_target"] == first and first % 4 == 0 and first < 30
    assert reached["steps"] == first  # no step after the target
    assert 0 < reached["time_to_target_s"] <= reached["train_time_s"]
    assert reached["eval_time_s"] > 0
    # The same accuracies against training time only (evaluation does not move this axis): the bench reads a
    # lower target's time from it, on the way to the one the run stopped at.
    curve = bench.accuracy_curve(tmp_path)
    assert list(curve.values()) == [accuracy for _, accuracy in evaluated] and sorted(curve) == list(curve)
    assert bench.seconds_to(curve, 0.3) == pytest.approx(reached["time_to_target_s"], abs=1e-3)
    lower = bench.seconds_to(curve, 0.15)
    assert lower <= bench.seconds_to(curve, 0.3) and all(
        accuracy < 0.15 for at, accuracy in curve.items() if at < lower
    )
    assert bench.seconds_to(curve, 1.01) is None


def test_bad_target_settings_are_one_line(make_config):
    for override in ("target_accuracy=1.5", "eval_every_steps=-1"):
        with pytest.raises(ConfigError, match=re.escape(override)):
            validate_here(make_config(override))


def test_recipes_classic_is_the_defaults_and_fast_chooses_its_groups(make_config):
    assert make_config("recipe=classic") == make_config()
    fast = make_config("recipe=fast", "batch_size=128")  # the command line still wins over the recipe
    assert (fast.recipe, fast.batch_size, fast.label_smoothing) == ("fast", 128, 0.1)
    assert fast.model["_target_"] == "mnist_dist.model.FastNet"
    assert fast.scheduler["max_lr"] == fast.optim["lr"]


def test_the_fast_recipe_evaluates_several_times_an_epoch_changing_no_weight_and_steps_one_cycle_every_step(
    make_config, tmp_path
):
    every = make_config("recipe=fast").eval_every_steps
    assert every and 234 // every >= 4  # Fashion-MNIST's epoch at batch 256: a curve per mode in TensorBoard
    for name, evaluations in (
        ("epoch_ends", ("eval_every_steps=0",)),
        ("often", ("eval_every_steps=3",)),
    ):
        (tmp_path / name).mkdir()
        narrow = "model.widths=[4,8,8]"  # BatchNorm is what counts, not the width
        settings = ("epochs=2", "batch_size=64", "log_every=1", *evaluations)  # 20 steps
        launch(make_config("recipe=fast", narrow, *settings), tmp_path / name)
    # every 3 steps and at every epoch's end
    assert list(read_scalars(tmp_path / "often")["test/accuracy"]) == [3, 6, 9, 10, 12, 15, 18, 20]
    # Evaluations in mid-epoch hand the model back in training mode: else BatchNorm's statistics would differ.
    often, epoch_ends = (torch.load(tmp_path / name / "model.pt") for name in ("often", "epoch_ends"))
    assert all(torch.equal(often[key], epoch_ends[key]) for key in often)
    lr = scalars(tmp_path / "often")["train/lr"]
    assert len(lr) == 20
    peak = lr.index(max(lr))  # one cycle warms up over pct_start = 25 % of the 20 steps, then anneals
    assert peak == 3 and lr[peak] == pytest.approx(0.01, rel=1e-6) and lr[-1] < lr[peak] / 50
