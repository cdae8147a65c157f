"""Files the app writes into a run directory (issue 27, round 3): a symlink planted there is replaced or
refused, never written through, and every file follows the user's umask, so a teammate sharing the
experiment directory can read the results. Each test failed on commit f307ea7."""

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import compose_config

from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint, results
from mnist_dist.operations.errors import describe_os_error, last_resort

SHORT = ("epochs=1", "batch_size=32")
PRECIOUS = "someone else's file\n"


def plant(link: Path, target: Path) -> None:
    target.write_text(PRECIOUS)
    link.symlink_to(target)


@contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def test_symlinks_planted_where_a_run_writes_are_replaced_and_their_targets_untouched(tiny_root, tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    names = ("config.yaml", "results.json", "model.pt", "checkpoint.pt")
    for name in names:
        plant(run_dir / name, elsewhere / name)
    launch(compose_config(tiny_root, *SHORT), run_dir)
    for name in names:
        assert (elsewhere / name).read_text() == PRECIOUS, name
        assert not (run_dir / name).is_symlink() and (run_dir / name).stat().st_size > 0, name
    assert "batch_size: 32" in (run_dir / "config.yaml").read_text()


def test_a_symlink_planted_as_a_rank_log_is_refused_in_one_line(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plant(run_dir / "rank_0.log", tmp_path / "target")
    with pytest.raises(OSError) as error:
        launch(compose_config(tiny_root, *SHORT), run_dir)
    assert describe_os_error(error.value) == (
        f"cannot write {run_dir}/rank_0.log: it is a symbolic link, which mnist_dist does not write through; remove it"
    )
    assert (tmp_path / "target").read_text() == PRECIOUS
    # the last-resort traceback of an unforeseen error does not follow it either
    assert last_resort(RuntimeError("boom"), run_dir / "rank_0.log").startswith("error: RuntimeError: boom (no log: ")
    assert (tmp_path / "target").read_text() == PRECIOUS


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
