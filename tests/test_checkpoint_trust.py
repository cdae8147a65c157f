"""What a checkpoint can be trusted with (issue 27, round 3): no checkpoint holds weights that were not
checked. Each test failed on commit f307ea7."""

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from mnist_dist import checkpoint
from mnist_dist.launch import launch
from mnist_dist.step import TrainingDiverged

# 640 tiny images at batch 32: 20 steps an epoch
SHORT = ("epochs=1", "batch_size=32")
FAILING = ("model._target_=failing_model.FailingConvNet", "+model.fail_rank=0")


def saved_step(path: Path) -> int:
    state = torch.load(path, weights_only=True)
    assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point()), path
    return state["step"]


# --- 1. no checkpoint from unchecked weights ---------------------------------------------------


def test_a_nan_loss_between_log_windows_is_never_checkpointed(tiny_root, tmp_path):
    # log_every=5 checks the loss at step 5 only; checkpoints at every step used to save steps 3 and 4
    # (NaN weights) and rotate the good ones away, and the error then pointed at them.
    cfg = compose_config(tiny_root, *SHORT, "log_every=5", "checkpoint_every_steps=1", *FAILING, "+model.nan=true")
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the training loss is nan at step 3 (rank 0); lower optim.lr, check the data, or resume from "
        f"{tmp_path}/checkpoint.pt (step 2, checked)"
    )
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and saved_step(tmp_path / "checkpoint.1.pt") == 1


def test_weights_poisoned_by_a_step_with_a_finite_loss_are_never_checkpointed(tiny_root, tmp_path):
    # nan_grad: step 4's loss is finite, its update makes every weight NaN; step 4 is a checkpoint step.
    settings = ("log_every=10", "checkpoint_every_steps=2", *FAILING, "+model.fail_step=4", "+model.nan_grad=true")
    cfg = compose_config(tiny_root, *SHORT, *settings)
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the weights are not finite after step 4 (rank 0, features.0.weight); lower optim.lr, check the data, or "
        f"resume from {tmp_path}/checkpoint.pt (step 2, checked)"
    )
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and not (tmp_path / "checkpoint.1.pt").exists()


def test_divergence_at_the_last_step_fails_the_run_and_writes_no_results(tiny_root, tmp_path):
    cfg = compose_config(tiny_root, *SHORT, *FAILING, "+model.fail_step=20", "+model.nan_grad=true")
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the test loss is nan after step 20 (rank 0); lower optim.lr or check the data (no checkpoint was "
        "written before it)"
    )
    assert {p.name for p in tmp_path.iterdir()} & {"results.json", "model.pt", "checkpoint.pt"} == set()


def _no_constants(name: str):
    raise AssertionError(f"{name} in strict JSON")


def test_results_json_is_strict_json(tmp_path):
    inf = float("inf")
    checkpoint.save_json({"loss": float("nan"), "times": [inf, 1.5], "peak": {"x": -inf}, "n": 3}, tmp_path / "r.json")
    parsed = json.loads((tmp_path / "r.json").read_text(), parse_constant=_no_constants)
    assert parsed == {"loss": None, "times": [None, 1.5], "peak": {"x": None}, "n": 3}
