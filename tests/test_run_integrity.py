"""Issue 38: nothing of a run is lost to a new launch, a checkpoint's position is checked before it resumes, and a
full disk is one error naming what could not be written. Each test failed on commit ee05943."""

import errno
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import HANG_S, compose_config

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.operations.errors import log_thread_errors
from mnist_dist.operations.rundir import HYDRA_OWN
from mnist_dist.operations.tensorboard import Scalars
from mnist_dist.tools import write_idx

TINY = ("data.mirrors=[]", "progress=false", "batch_size=32")


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """A finished one-epoch run (20 steps) with checkpoint.pt (step 20) and checkpoint.1.pt (step 10)."""
    run = tmp_path_factory.mktemp("trained")
    launch(compose_config(tiny_root, "epochs=1", "batch_size=32", "checkpoint_every_steps=10"), run)
    return run


def contents(run: Path) -> dict:
    """What the run wrote; Hydra's own record of the latest launch (.hydra/, mnist_dist.log) is Hydra's."""
    written = [p for p in sorted(run.rglob("*")) if p.is_file() and p.stat().st_size]
    return {str(p.relative_to(run)): p.read_bytes() for p in written if p.relative_to(run).parts[0] not in HYDRA_OWN}


def test_a_fresh_launch_into_a_finished_run_replaces_nothing(tiny_root, trained, tmp_path, cli_in_process):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = contents(run)
    code = cli_in_process(f"data.root={tiny_root}", *TINY, "epochs=1", f"hydra.run.dir={run}")
    assert code == (
        f"error: {run} holds a finished run (results.json, model.pt, checkpoint.pt), which a fresh run would "
        "replace; pass another hydra.run.dir"
    )
    assert contents(run) == before  # results, model, the one TensorBoard run


@pytest.mark.slow
def test_two_launches_into_one_directory_at_once_never_share_it(tmp_path):
    """Hydra names the default directory by the second: two launches in one second ask for the same one. One
    trains; the other is refused, by the live run's lock or by the finished run it would replace."""
    write_idx(tmp_path / "data" / "MNIST" / "raw")
    argv = [sys.executable, "-m", "mnist_dist", f"data.root={tmp_path}/data", *TINY, "epochs=1"]
    runs = [
        subprocess.Popen([*argv, "hydra.run.dir=outputs/same_second"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    codes = [run.wait(timeout=HANG_S) for run in runs]
    refused = runs[codes.index(1)].stderr.read()
    assert sorted(codes) == [0, 1] and re.search("in use by another run|holds a finished run", refused), refused
    run = tmp_path / "outputs" / "same_second"
    assert (run / "results.json").is_file() and (run / "rank_0.log").read_text().count("results: ") == 1


def test_a_fresh_launch_into_an_unfinished_run_says_resume_auto(tiny_root, trained, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained / "checkpoint.pt", run)
    with pytest.raises(ConfigError, match="holds an unfinished run .checkpoint.pt.*; pass resume=auto"):
        launch(compose_config(tiny_root, "epochs=2", "batch_size=32"), run)


@pytest.mark.parametrize("epoch_step", [21, 10**6])  # the epoch has 20 steps: 20 is a preemption at its last step
def test_a_position_past_the_end_of_its_epoch_is_refused_and_nothing_is_written(
    tiny_root, trained, tmp_path, epoch_step
):
    # before: the resumed run skipped the rest of epoch 1, trained none of it and exited 0
    run = tmp_path / "run"
    run.mkdir()
    state = checkpoint.load(trained / "checkpoint.1.pt")  # step 10, mid-epoch 1
    checkpoint.save(
        {**state, "epoch_step": epoch_step, "step": epoch_step, "format": checkpoint.FORMAT}, run / "checkpoint.pt"
    )
    before = contents(run)
    with pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *TINY, "epochs=1", f"resume={run}"), tmp_path / "new")
    assert str(error.value) == (
        f"resume: the checkpoint is {epoch_step} steps into epoch 1, which has 20 steps here (640 images at "
        "batch_size=32): damaged, crafted, or saved at a smaller batch_size; resume from another checkpoint.pt"
    )
    assert contents(run) == before and not (tmp_path / "new").exists()


def test_a_full_disk_under_tensorboard_is_one_error_naming_its_directory(tmp_path, capfd, monkeypatch):
    from tensorboard.summary.writer.record_writer import RecordWriter

    log_thread_errors(logging.getLogger("test_run_integrity"))
    scalars = Scalars(tmp_path, rank=0)
    scalars.add(1, loss=1.0)

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(RecordWriter, "write", full)
    with pytest.raises(OSError) as error:
        for step in range(2, 100_000):  # until the writer's thread has failed and its error comes back
            scalars.add(step, loss=1.0)
            time.sleep(0.001)
    monkeypatch.undo()
    assert (error.value.errno, error.value.filename) == (errno.ENOSPC, str(tmp_path / "tb"))
    assert "Traceback" not in capfd.readouterr().err
    threading.excepthook = threading.__excepthook__
