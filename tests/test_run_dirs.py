"""Two launches never share a run directory, every job of a sweep gets its own, a refused launch changes nothing
on disk, a directory the user made is never removed. (A fresh launch into a finished run: test_checkpoint.)"""

import re
import subprocess
import sys

import pytest
from helpers import HANG_S

from mnist_dist import __main__ as command
from mnist_dist.launch import launch
from mnist_dist.operations import rundir
from mnist_dist.tools import write_idx

TINY = ("data.mirrors=[]", "progress=false", "epochs=1", "batch_size=64", "model._target_=failing_model.NarrowConvNet")


def files(run):
    """What a run wrote; the lock's empty file stays where a launch took it (filelock leaves it, unlocked)."""
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != rundir.LOCK}


@pytest.mark.slow  # two trainings
def test_a_sweep_over_the_data_root_keeps_both_jobs(tiny_root, tmp_path, monkeypatch, cli_in_process):
    other_root = tmp_path / "other_root"
    (other_root / "MNIST").mkdir(parents=True)
    (other_root / "MNIST" / "raw").symlink_to(tiny_root / "MNIST" / "raw")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["mnist_dist", "-m", f"data.root={tiny_root},{other_root}", *TINY, "hydra.sweep.dir=sweep"]
    )
    command.main()  # a sweep that completes returns (cli_in_process: its signal handlers put back)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    named = "single_batch_size=64,epochs=1,model._target_=failing_model.NarrowConvNet"  # Hydra's override_dirname
    assert jobs == [f"0_{named}", f"1_{named}"]
    assert all((tmp_path / "sweep" / job / "results.json").is_file() for job in jobs)


def test_a_refused_launch_changes_nothing_on_disk(make_config, tiny_root, tmp_path, monkeypatch, cli_in_process):
    run = tmp_path / "run"
    run.mkdir()
    launch(make_config(*TINY), run)  # a finished run; what the command line then does is the test
    before = files(run)
    monkeypatch.chdir(tmp_path)
    assert "has finished epoch 1 of 1" in cli_in_process(f"data.root={tiny_root}", *TINY, f"resume={run}")
    assert files(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nor the directory Hydra made for the launch


def test_a_directory_the_user_made_stays_as_it_was_after_a_failure(tiny_root, tmp_path, cli_in_process):
    mine, notes = tmp_path / "mine", tmp_path / "notes" / "notes.txt"
    mine.mkdir(), notes.parent.mkdir()
    notes.write_text("mine")
    for run in (mine, notes.parent):  # empty, or holding the user's files
        code = cli_in_process(f"data.root={tiny_root}", *TINY, "model._target_=nowhere.Net", f"hydra.run.dir={run}")
        assert code.startswith("error: model._target_=nowhere.Net cannot be imported")
    assert mine.is_dir() and notes.read_text() == "mine"
    # (braces in a path are a path: test_launch's ddp run writes into run_{rank}/)


@pytest.mark.slow
def test_two_launches_into_one_directory_at_once_never_share_it(tmp_path):
    """Hydra names the default directory by the second: two launches in one second ask for the same one. One
    trains; the other is refused, by the live run's lock or by the finished run it would replace."""
    write_idx(tmp_path / "data" / "MNIST" / "raw")
    argv = [sys.executable, "-m", "mnist_dist", f"data.root={tmp_path}/data", *TINY]
    runs = [
        subprocess.Popen([*argv, "hydra.run.dir=outputs/same_second"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    codes = [run.wait(timeout=HANG_S) for run in runs]
    refused = runs[codes.index(1)].stderr.read()
    assert sorted(codes) == [0, 1] and re.search("in use by another run|holds a finished run", refused), refused
    run = tmp_path / "outputs" / "same_second"
    assert (run / "results.json").is_file() and (run / "rank_0.log").read_text().count("results: ") == 1
