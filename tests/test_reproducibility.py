"""Reproducibility as a tested property: repeatable runs, exact resume, and the compare command."""

import json
import subprocess
import sys
from functools import partial

import pytest
import torch
from helpers import compose_config, scalars

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.tools.compare import compare

SHORT = ("epochs=2", "batch_size=64", "log_every=1")


def run(make_config, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(make_config(*SHORT, *overrides), run_dir)
    return torch.load(run_dir / "model.pt"), scalars(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tiny_root, tmp_path_factory):
    """``uninterrupted(mode)``: the weights and scalars of one run of SHORT on 2 devices, made once a module
    for the tests that compare other runs with it."""
    runs = {}

    def get(mode: str):
        if mode not in runs:
            run_dir = tmp_path_factory.mktemp(mode)
            runs[mode] = run(partial(compose_config, tiny_root), run_dir, f"mode={mode}", "gpus=2")
        return runs[mode]

    return get


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ"


class TinyMLP(torch.nn.Sequential):
    """fp16 convolutions take a slow reference path on a CPU: an MLP keeps the fp16 run short."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def test_checkpoint_carries_the_fp16_loss_scale(make_config, tmp_path):
    run(
        make_config,
        tmp_path,
        "amp=fp16",
        "epochs=1",
        "batch_size=320",
        "model._target_=test_reproducibility.TinyMLP",
        "~model.dropout",
    )
    scaler = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["scaler"]
    assert scaler["scale"] > 1 and scaler["_growth_tracker"] == 2  # two steps without an overflow


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_same_config_twice_gives_identical_curves(make_config, uninterrupted, tmp_path, mode):
    # Dropout stays on: each rank's masks come from (seed, rank), so they repeat too.
    first_weights, first = uninterrupted(mode)
    second_weights, second = run(make_config, tmp_path, f"mode={mode}", "gpus=2")
    assert first["rank_0/train/loss"] == second["rank_0/train/loss"] and len(first["rank_0/train/loss"]) == 20
    assert first["test/accuracy"] == second["test/accuracy"]
    assert_same_weights(first_weights, second_weights)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_resume_equals_uninterrupted(make_config, uninterrupted, tmp_path, mode):
    whole_weights, whole = uninterrupted(mode)
    part = tmp_path / "part"
    run(make_config, part, f"mode={mode}", "gpus=2", "epochs=1")
    after_one = (part / "checkpoint.pt").read_bytes()
    # Finish the run, then pretend it crashed during epoch 2 after logging: the checkpoint is the
    # epoch-1 one again while TensorBoard already holds epoch 2. Resuming must not duplicate steps.
    launch(make_config(*SHORT, f"mode={mode}", "gpus=2", f"resume={part}"), tmp_path / "unused")
    (part / "checkpoint.pt").write_bytes(after_one)
    launch(make_config(*SHORT, f"mode={mode}", "gpus=2", f"resume={part}/checkpoint.pt"), tmp_path / "unused")
    assert not (tmp_path / "unused").exists()  # resumed runs go on in their own directory
    assert_same_weights(torch.load(part / "model.pt"), whole_weights)
    resumed = scalars(part)
    assert resumed["rank_0/train/loss"] == whole["rank_0/train/loss"]  # 20 steps, none twice, same values
    assert resumed["test/accuracy"] == whole["test/accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single"])  # ddp: test_restarted_and_requeued_jobs_end_as_an_uninterrupted_run
def test_mid_epoch_resume_equals_uninterrupted(make_config, tmp_path, mode):
    # 2 epochs of 10 steps, a checkpoint every 3 steps: saved at 3, 6, 9, 10 (epoch end), 12, 15, 18, 20;
    # the 3 kept are 20, 18 and 15. resume=auto starts the first run fresh and continues the second.
    every = (f"mode={mode}", "gpus=2", "epochs=2", "checkpoint_every_steps=3", "keep_checkpoints=3", "resume=auto")
    whole_weights, whole = run(make_config, tmp_path / "whole", *every)
    assert sorted(p.name for p in (tmp_path / "whole").glob("checkpoint*")) == [
        "checkpoint.1.pt",
        "checkpoint.2.pt",
        "checkpoint.pt",
    ]
    state = checkpoint.load(tmp_path / "whole" / "checkpoint.2.pt")
    assert (state["epoch"], state["epoch_step"], state["step"]) == (1, 5, 15)  # mid-epoch 2
    part = tmp_path / "part"
    part.mkdir()
    (part / "checkpoint.pt").write_bytes((tmp_path / "whole" / "checkpoint.2.pt").read_bytes())
    resumed_weights, resumed = run(make_config, part, *every)
    assert_same_weights(resumed_weights, whole_weights)
    assert (
        resumed["rank_0/train/loss"] == whole["rank_0/train/loss"][15:]
    )  # steps 16 to 20, with dropout (every rank's RNG)


def test_a_missing_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(ConfigError) as error:
        checkpoint.locate(str(tmp_path / "old"))
    assert str(error.value) == (
        f"resume={tmp_path / 'old'}: no checkpoint there; pass a run directory that holds checkpoint.pt, or the "
        "file itself"
    )


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


@pytest.mark.slow
def test_compare_command_writes_table_json_and_chart(tiny_root, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_dist.tools.compare",
            "modes=[single,dp,ddp]",
            "repeats=1",
            "gpus=2",
            f"data.root={tiny_root}",
            "data.mirrors=[]",
            "epochs=1",
            "batch_size=32",
            "log_every=2",
            "progress=false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (out,) = (tmp_path / "outputs" / "compare").glob("*/*")
    report = json.loads((out / "compare.json").read_text())
    assert [row["mode"] for row in report["rows"]] == ["single", "dp", "ddp"]
    assert report["agree"] and max(row["max_loss_diff"] for row in report["rows"]) < 1e-5
    table = (out / "compare.md").read_text()
    assert table in result.stdout and "modes agree" in table
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["ddp", "dp", "single"]
