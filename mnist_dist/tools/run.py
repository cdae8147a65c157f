"""One training run in a fresh process, as the tools start it: ``python -m mnist_dist`` with overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train_in_subprocess(overrides: list[str], run_dir: Path) -> dict:
    """``python -m mnist_dist <overrides>`` in a fresh process writing to ``run_dir``, without a bar; its
    results.json. A failed run raises RuntimeError with its exit status and last error line."""
    command = [sys.executable, "-m", "mnist_dist", *overrides, "progress=false", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no error output"])[-1]
        raise RuntimeError(f"exit {result.returncode}: {last}")
    return json.loads((run_dir / "results.json").read_text())
