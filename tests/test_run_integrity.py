"""Issue 38: nothing of a run is lost to a new launch or a skipped checkpoint, checkpoints are verified
before they resume, and nothing is written through a link the run did not make (a checkpoint.pt link, a
tb link, TensorBoard's own file). Each test failed on commit ee05943."""

import errno
import logging
import os
import shutil
import struct
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.operations.errors import NoFollowFileHandler, log_thread_errors
from mnist_dist.operations.tensorboard import Scalars

TINY = ("data.mirrors=[]", "progress=false", "batch_size=32")


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """A finished one-epoch run (20 steps) with checkpoint.pt (step 20) and checkpoint.1.pt (step 10)."""
    run = tmp_path_factory.mktemp("trained")
    launch(compose_config(tiny_root, "epochs=1", "batch_size=32", "checkpoint_every_steps=10"), run)
    return run


def contents(run: Path) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.stat().st_size}


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


def test_a_fresh_launch_into_an_unfinished_run_says_resume_auto(tiny_root, trained, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained / "checkpoint.pt", run)
    with pytest.raises(ConfigError, match="holds an unfinished run .checkpoint.pt.*; pass resume=auto"):
        launch(compose_config(tiny_root, "epochs=2", "batch_size=32"), run)


def flip_a_byte_of_the_weights(path: Path) -> None:
    with zipfile.ZipFile(path) as archive:
        entry = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[entry.header_offset + 26 : entry.header_offset + 30])
    data[entry.header_offset + 30 + name_length + extra_length + 100] ^= 0xFF  # inside the first tensor's bytes
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_checkpoint_are_refused_before_it_resumes(trained, tmp_path):
    shutil.copy(trained / "checkpoint.pt", tmp_path / "checkpoint.pt")
    flip_a_byte_of_the_weights(tmp_path / "checkpoint.pt")
    with pytest.raises(ConfigError, match=r"its bytes are not the ones written \(checksum of archive/data/\d+ wrong\)"):
        checkpoint.load(tmp_path / "checkpoint.pt")


def test_resume_auto_past_a_damaged_checkpoint_keeps_the_one_it_resumed_from(trained, tmp_path):
    for name in ("checkpoint.pt", "checkpoint.1.pt"):
        shutil.copy(trained / name, tmp_path / name)
    flip_a_byte_of_the_weights(tmp_path / "checkpoint.pt")
    good = (tmp_path / "checkpoint.1.pt").read_bytes()
    assert checkpoint.newest_readable(tmp_path) == tmp_path / "checkpoint.1.pt"
    checkpoint.save_kept({"step": 11}, tmp_path / "checkpoint.pt", keep=2)  # the resumed run's next save
    assert (tmp_path / "checkpoint.1.pt").read_bytes() == good
    assert torch.load(tmp_path / "checkpoint.pt") == {"step": 11}


def test_rotation_closes_the_gaps_that_damaged_checkpoints_leave(trained, tmp_path):
    path, state = tmp_path / "checkpoint.pt", checkpoint.load(trained / "checkpoint.pt")
    for step, name in enumerate(["checkpoint.3.pt", "checkpoint.2.pt", "checkpoint.1.pt", "checkpoint.pt"]):
        checkpoint.save({**state, "step": step, "format": checkpoint.FORMAT}, tmp_path / name)
    (tmp_path / "checkpoint.1.pt").write_bytes(b"damaged")

    def steps() -> dict:
        return {p.name: torch.load(p, weights_only=True)["step"] for p in sorted(tmp_path.iterdir())}

    checkpoint.save_kept({**state, "step": 9}, path, keep=4)
    assert steps() == {"checkpoint.pt": 9, "checkpoint.1.pt": 3, "checkpoint.2.pt": 1, "checkpoint.3.pt": 0}
    checkpoint.save_kept({**state, "step": 10}, path, keep=4)  # the usual rotation: everything one place up
    assert steps() == {"checkpoint.pt": 10, "checkpoint.1.pt": 9, "checkpoint.2.pt": 3, "checkpoint.3.pt": 1}


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


def test_a_file_system_without_hard_links_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    for step in (1, 2):
        checkpoint.save_kept({"step": step}, tmp_path / "checkpoint.pt", keep=2)
    assert [torch.load(tmp_path / n)["step"] for n in ("checkpoint.pt", "checkpoint.1.pt")] == [2, 1]


def test_a_checkpoint_link_is_not_resumed_by_resume_auto(tiny_root, trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained, elsewhere)
    before = contents(elsewhere)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").symlink_to(elsewhere / "checkpoint.pt")
    with pytest.raises(ConfigError, match=r"checkpoint.pt \(not a file of this run directory"):
        launch(compose_config(tiny_root, "epochs=2", "batch_size=32", "resume=auto"), run)
    assert contents(elsewhere) == before


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_a_planted_tb_link_is_refused_and_its_target_untouched(tiny_root, trained, tmp_path, resumed):
    victim = tmp_path / "victim"
    shutil.copytree(trained / "tb", victim)
    before = contents(victim)
    run = tmp_path / "run"
    if resumed:
        shutil.copytree(trained, run)
        shutil.rmtree(run / "tb")
    else:
        run.mkdir()
    (run / "tb").symlink_to(victim)
    overrides = ("epochs=2", "batch_size=32", *(("resume=auto",) if resumed else ()))
    with pytest.raises(OSError) as error:
        launch(compose_config(tiny_root, *overrides), run)
    assert error.value.filename == str(run / "tb") and "symbolic link" in error.value.strerror
    assert contents(victim) == before  # neither written into nor purged


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


def test_a_full_disk_under_the_rank_log_is_one_error_naming_it(tmp_path, capfd):
    log = logging.getLogger("test_run_integrity.rank")
    handler = NoFollowFileHandler(tmp_path / "rank_0.log")
    log.addHandler(handler)
    try:
        log.warning("opened")

        def full(text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        handler.stream.write = full
        with pytest.raises(OSError) as error:
            log.warning("no room for this")
    finally:
        log.removeHandler(handler)
        handler.close()
    assert (error.value.errno, error.value.filename) == (errno.ENOSPC, str(tmp_path / "rank_0.log"))
    assert "Logging error" not in capfd.readouterr().err
