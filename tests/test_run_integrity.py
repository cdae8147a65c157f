"""Two launches never share a run directory. (A fresh launch into a finished run: test_checkpoint.)"""

import re
import subprocess
import sys

import pytest
from helpers import HANG_S

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
