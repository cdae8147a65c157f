"""Messages that were unclear: each is one line now, saying what to do."""

import subprocess
import sys

import pytest
from helpers import HANG_S

from mnist_dist.tools import compare


def test_compare_of_a_run_shorter_than_log_every_is_one_line(tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["modes=[single]", "repeats=1", f"data.root={tiny_root}", "data.mirrors=[]", "progress=false", "epochs=1"]
    with pytest.raises(SystemExit) as exit_:
        # 10 steps at batch 64
        compare.main([*argv, "model._target_=failing_model.NarrowConvNet", "log_every=1000"], load=lambda: 0.0)
    (run_dir,) = (tmp_path / "outputs" / "compare").glob("*/*/single")
    assert exit_.value.code.startswith(f"error: {run_dir.relative_to(tmp_path)} logged no training loss")
    assert "smaller log_every=" in exit_.value.code


def test_a_run_directory_that_cannot_be_written_says_so(tiny_root):
    argv = [f"data.root={tiny_root}", "data.mirrors=[]", "hydra.run.dir=/proc/self"]
    result = subprocess.run([sys.executable, "-m", "mnist_dist", *argv], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: cannot write /proc/self/")
