"""docs/gpus.md's offline command installs from the bundle alone, on a GPU machine's own stack, and without
CUDA the check says so in one line.

The stack is the Python that MNIST_DIST_STACK_PYTHON names (3.12 with its own torch, no hydra: .ci/run builds
one); MNIST_DIST_OFFLINE_BUNDLE names a bundle already built (else the test builds one, which needs pip's index).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def documented_command() -> str:
    """The first bash block of the section: the test runs what the page says, so the two cannot drift."""
    section = (ROOT / "docs" / "gpus.md").read_text().split("\n## An offline GPU machine\n", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)


def clone_of_the_repo(clone: Path) -> None:
    """The git-tracked files as they are in the working tree: what a clone carried to the machine holds."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True)
    for name in filter(None, tracked.stdout.split("\0")):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, clone / name)


@pytest.mark.slow
def test_the_offline_command_installs_from_the_bundle_alone_and_says_cuda_is_missing(tmp_path):
    stack = os.environ.get("MNIST_DIST_STACK_PYTHON")
    if not stack:
        pytest.skip("MNIST_DIST_STACK_PYTHON is unset: it names a GPU machine's Python (3.12, torch, no hydra)")
    has = lambda module: subprocess.run([stack, "-c", f"import {module}"], capture_output=True).returncode == 0  # noqa: E731
    assert has("torch") and not has("hydra"), f"{stack} is not the stack claimed: it must have torch, not hydra"
    clone = tmp_path / "clone"
    clone_of_the_repo(clone)
    if bundle := os.environ.get("MNIST_DIST_OFFLINE_BUNDLE"):
        shutil.copytree(bundle, clone / "offline")
    else:
        built = [sys.executable, "-m", "mnist_dist.tools.offline_bundle", str(clone / "offline")]
        subprocess.run(built, cwd=ROOT, check=True, capture_output=True, timeout=300)
    # `python3` is the stack's: a script, not a symlink (a venv's python linked from elsewhere is not in its venv)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{stack}" "$@"\n')
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
        "PIP_CONFIG_FILE": os.devnull,  # no find-links or extra index from this machine's pip config
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens there: no index, even without --no-index
        "PIP_NO_INDEX": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run(
        ["bash", "-c", documented_command()], cwd=clone, env=env, capture_output=True, text=True, timeout=600
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 1 and re.fullmatch(r"gpu_check: no CUDA device is visible[^\n]*", output), output
    imported = subprocess.run(
        [".venv-gpu/bin/python", "-c", "import hydra, omegaconf, mnist_dist.conf; print(mnist_dist.conf.__file__)"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0 and imported.stdout.startswith(str(clone)), imported.stderr
