"""Files the app writes into a run directory (issue 27, round 3) follow the user's umask, so a teammate sharing the
experiment directory can read the results. Each test failed on commit f307ea7."""

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import compose_config

from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint, results

SHORT = ("epochs=1", "batch_size=32")


@contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_files_of_a_run_follow_the_umask(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with umask(0o027):
        launch(compose_config(tiny_root, *SHORT, "checkpoint_every_steps=10"), run_dir)
    written = ("results.json", "model.pt", "checkpoint.pt", "checkpoint.1.pt", "config.yaml", "rank_0.log")
    assert {name: oct(mode_of(run_dir / name)) for name in written} == dict.fromkeys(written, oct(0o640))


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_an_atomic_write_follows_the_umask(tmp_path, mask):
    with umask(mask):
        checkpoint.save({"epoch": 1}, tmp_path / "checkpoint.pt")
        results.save_json({"a": 1}, tmp_path / "results.json")
    assert mode_of(tmp_path / "checkpoint.pt") == mode_of(tmp_path / "results.json") == 0o666 & ~mask
