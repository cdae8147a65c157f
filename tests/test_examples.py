"""The examples run as users run them, and the guide's DDP script runs as printed: exit 0, a checked result."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mnist_dist.model import ConvNet

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_ddp_regression_learns_on_two_cpu_ranks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_regression.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    mse, variance = map(
        float,
        re.search(
            r"test MSE ([\d.]+) \(target variance ([\d.]+)\), replicas identical: "
            r"True\n",
            result.stdout,
        ).groups(),
    )
    assert 0.4 < variance < 0.6 and mse < variance / 10
    assert result.stdout.endswith("ok\n")


@pytest.mark.slow
def test_the_guides_ddp_script_runs_as_printed(tiny_root, tmp_path):
    guide = (ROOT / "docs" / "CONVERTING.md").read_text()
    script = guide.split("<!-- tests/test_examples.py runs the next code block -->\n```python\n")[1].split("```")[0]
    assert "EPOCHS, BATCH_SIZE, SEED = 14, 64, 1" in script
    (tmp_path / "mnist_ddp.py").write_text(script.replace("= 14, 64, 1", "= 1, 64, 1"))  # one epoch
    result = subprocess.run(
        [sys.executable, "mnist_ddp.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "MNIST_DIST_DATA": str(tiny_root)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    accuracy = float(re.fullmatch(r"epoch 1: test loss [\d.]+, accuracy ([\d.]+)%\n", result.stdout).group(1))
    assert accuracy >= 90
    ConvNet().load_state_dict(torch.load(tmp_path / "mnist_cnn.pt"))  # saved without "module."
