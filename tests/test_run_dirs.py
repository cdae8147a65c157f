"""Every job of every sweep gets its own directory, a refused launch changes nothing on disk, a directory
the user made is never removed, and a path with braces is a path."""

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


def test_jobs_that_differ_only_in_keys_left_out_of_the_name_get_their_own_directories(tmp_path):
    sweep = str(tmp_path / "sweep")
    first, again, other = (rundir.unique_subdir(sweep, "ddp_epochs=1", job) for job in (0, 1, 2))
    assert (first, again, other) == ("ddp_epochs=1", "ddp_epochs=1_2", "ddp_epochs=1_3")
    assert rundir.unique_subdir(sweep, "ddp_epochs=1", 1) == "ddp_epochs=1_2"  # resolved again: the same
    assert rundir.made_here(tmp_path / "sweep" / "ddp_epochs=1_2")


def test_the_lock_is_held_while_the_run_lives_and_leaves_with_it(tmp_path):
    with rundir.owned(tmp_path):
        assert (tmp_path / rundir.LOCK).is_file()
        with pytest.raises(ConfigError, match="is in use by another run that is still alive"), rundir.owned(tmp_path):
            pass
    assert not (tmp_path / rundir.LOCK).exists()  # a finished run's directory holds only what the run wrote
    with rundir.owned(tmp_path):  # and the next run takes it
        pass


@pytest.mark.slow
def test_a_sweep_over_the_data_root_keeps_both_jobs_and_a_second_sweep_in_the_same_second_its_own(tiny_root, tmp_path):
    other_root = tmp_path / "other_root"
    (other_root / "MNIST").mkdir(parents=True)
    (other_root / "MNIST" / "raw").symlink_to(tiny_root / "MNIST" / "raw")
    sweep = cli(tmp_path, "-m", f"data.root={tiny_root},{other_root}", *TINY, "hydra.sweep.dir=sweep")
    assert sweep.returncode == 0, sweep.stderr
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["single_batch_size=64,epochs=1", "single_batch_size=64,epochs=1_2"]
    assert all((tmp_path / "sweep" / job / "results.json").is_file() for job in jobs)


@pytest.mark.slow
def test_a_refused_launch_changes_nothing_on_disk(make_config, tiny_root, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    launch(make_config(*TINY), run)  # a finished run; what the command line then does is the test
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused = cli(tmp_path, f"data.root={tiny_root}", *TINY, f"hydra.run.dir={run}", f"resume={run}")
    assert refused.returncode == 1 and "has finished epoch 1 of 1" in refused.stderr
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


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
