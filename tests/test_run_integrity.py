"""Two launches never share a run directory, and a full disk under TensorBoard is one error naming what
could not be written. (A fresh launch into a finished run, a checkpoint's position: test_checkpoint.)"""

import errno
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import HANG_S

from mnist_dist.operations.errors import log_thread_errors
from mnist_dist.operations.tensorboard import Scalars
from mnist_dist.tools import write_idx

TINY = ("data.mirrors=[]", "progress=false", "batch_size=32", "model._target_=failing_model.NarrowConvNet")


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
