"""Messages that were unclear (issue 27): each is one line now, saying what to do. The others of that list
are beside the code they test: an empty split in test_data, leftover torchrun variables in test_slurm."""

import subprocess
import sys

import pytest
from helpers import HANG_S, validate_here

from mnist_dist.config import ConfigError
from mnist_dist.tools import compare


@pytest.mark.parametrize("seed", [2**64, 2**32, -1])
def test_a_seed_out_of_range_is_one_line(make_config, seed):
    with pytest.raises(ConfigError) as error:
        validate_here(make_config(f"seed={seed}"))
    assert str(error.value) == (
        f"seed={seed} must be from 0 to 4294967295: the data order and every rank's random state are seeded "
        "from it within torch's 64 bits"
    )


def run_compare(tiny_root, tmp_path, monkeypatch, *overrides: str) -> str:
    monkeypatch.chdir(tmp_path)
    argv = ["modes=[single]", "repeats=1", f"data.root={tiny_root}", "data.mirrors=[]", "progress=false", "epochs=1"]
    with pytest.raises(SystemExit) as exit_:
        compare.main([*argv, *overrides], load=lambda: 0.0)
    return exit_.value.code


def test_compare_of_a_diverging_run_is_one_line(tiny_root, tmp_path, monkeypatch):
    message = run_compare(
        tiny_root,
        tmp_path,
        monkeypatch,
        "log_every=1",
        "model._target_=failing_model.FailingConvNet",
        "+model.fail_rank=0",
        "+model.nan=true",
    )
    assert message == (
        "error: the training loss is nan at step 3 (rank 0); lower optim.lr or check the data (no checkpoint was "
        "written before it)"
    )


def test_compare_of_a_run_shorter_than_log_every_is_one_line(tiny_root, tmp_path, monkeypatch):
    message = run_compare(tiny_root, tmp_path, monkeypatch, "log_every=1000")  # 10 steps at batch 64
    (run_dir,) = (tmp_path / "outputs" / "compare").glob("*/*/single")
    assert message == (
        f"error: {run_dir.relative_to(tmp_path)} logged no training loss: its run took fewer steps than "
        "log_every; pass a smaller log_every= or more epochs="
    )


# --- issue 38: messages that said something else than what was wrong ----------------------------------------


def test_a_run_directory_that_cannot_be_written_says_so(tiny_root):
    argv = [f"data.root={tiny_root}", "data.mirrors=[]", "hydra.run.dir=/proc/self"]
    result = subprocess.run([sys.executable, "-m", "mnist_dist", *argv], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: cannot write /proc/self/")
