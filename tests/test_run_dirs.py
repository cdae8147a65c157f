"""Every job of a sweep gets its own directory, a refused launch changes nothing on disk, a directory the user
made is never removed, and a path with braces is a path."""

import json
import subprocess
import sys

import pytest

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import rundir

TINY = ("data.mirrors=[]", "progress=false", "epochs=1", "batch_size=64")


def cli(cwd, *overrides, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mnist_dist", *overrides], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def files(run):
    """What a run wrote; the lock's empty file stays where a launch took it (filelock leaves it, unlocked)."""
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != rundir.LOCK}


def test_the_lock_is_held_while_the_run_lives_and_released_with_it(tmp_path):
    with rundir.owned(tmp_path), pytest.raises(ConfigError, match="in use by another run"), rundir.owned(tmp_path):
        pass
    with rundir.owned(tmp_path):  # the next run takes it
        pass


def test_a_sweep_refused_for_a_typo_leaves_nothing(tmp_path):
    refused = cli(tmp_path, "-m", "epoch=1,2")
    assert refused.returncode == 1 and "did you mean epochs" in refused.stderr
    assert list(tmp_path.iterdir()) == []  # before: outputs/multirun/<date>/<time>/multirun.yaml


@pytest.mark.slow
def test_a_sweep_over_the_data_root_keeps_both_jobs(tiny_root, tmp_path):
    other_root = tmp_path / "other_root"
    (other_root / "MNIST").mkdir(parents=True)
    (other_root / "MNIST" / "raw").symlink_to(tiny_root / "MNIST" / "raw")
    sweep = cli(tmp_path, "-m", f"data.root={tiny_root},{other_root}", *TINY, "hydra.sweep.dir=sweep")
    assert sweep.returncode == 0, sweep.stderr
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0_single_batch_size=64,epochs=1", "1_single_batch_size=64,epochs=1"]
    assert all((tmp_path / "sweep" / job / "results.json").is_file() for job in jobs)


@pytest.mark.slow
def test_a_refused_launch_changes_nothing_on_disk(make_config, tiny_root, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    launch(make_config(*TINY), run)  # a finished run; what the command line then does is the test
    before = files(run)
    refused = cli(tmp_path, f"data.root={tiny_root}", *TINY, f"resume={run}")
    assert refused.returncode == 1 and "has finished epoch 1 of 1" in refused.stderr
    assert files(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nor the directory Hydra made for the launch


@pytest.mark.slow
def test_a_directory_the_user_made_stays_and_braces_in_a_path_are_a_path(tiny_root, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    failed = cli(tmp_path, f"data.root={tiny_root}", *TINY, "model._target_=nowhere.Net", f"hydra.run.dir={mine}")
    assert failed.returncode == 1 and mine.is_dir()  # the user's own, empty before: still there
    braces = tmp_path / "run_{rank}"
    done = cli(tmp_path, f"data.root={tiny_root}", *TINY, "mode=ddp", "gpus=2", f"hydra.run.dir='{braces}'")
    assert done.returncode == 0, done.stderr
    assert json.loads((braces / "results.json").read_text())["world_size"] == 2
    assert (braces / "rank_1.log").is_file()
