"""What people run beside the trainer (``python -m mnist_dist.tools.<name>``): ``compare`` (do my modes agree,
which is fastest), ``bench`` (throughput per mode, time to accuracy), ``check`` (will my model train in every
mode), ``gpu_check`` (every CUDA path, on a GPU machine), ``offline_bundle`` (what such a machine without
network needs). Below: how they start training processes, and say when their speeds mean nothing."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mnist_dist.operations import files


def bounded(command: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """``command`` in a session of its own, its output captured. Past ``timeout`` seconds, or on Ctrl-C,
    the whole session (the ranks it spawned too) is killed; a timeout raises RuntimeError that says so."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as error:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if isinstance(error, subprocess.TimeoutExpired):
            raise RuntimeError(f"timed out after {timeout:g} s") from None
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def train_in_subprocess(overrides: list[str], run_dir: Path, timeout: float | None = None) -> dict:
    """``python -m mnist_dist <overrides>`` in a fresh process writing to ``run_dir``, killed with its ranks
    after ``timeout`` seconds; its results.json. A failed run raises RuntimeError with its exit status and last
    error line, or that it timed out."""
    command = [sys.executable, "-m", "mnist_dist", *overrides, "progress=false", f"hydra.run.dir={run_dir}"]
    result = bounded(command, timeout)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no error output"])[-1]
        raise RuntimeError(f"exit {result.returncode}: {last}")
    return json.loads((run_dir / "results.json").read_text())


def fractions(text: str) -> list[float]:
    """``0.91,0.92`` -> [0.91, 0.92], sorted; argparse says a bad one in one line."""
    with contextlib.suppress(ValueError):
        values = sorted(float(value) for value in text.split(","))
        if all(0 < value <= 1 for value in values):
            return values
    raise argparse.ArgumentTypeError(f"{text}: test accuracies as fractions in (0, 1], e.g. 0.91,0.92")


def save_chart(path: Path, draw: Callable) -> str:
    """``draw(pyplot)``'s figure saved to ``path`` as PNG; the file's name, or why there is none: matplotlib is
    an extra (``pip install -e '.[plot]'``) that only the charts need."""
    try:
        import matplotlib
    except ImportError:
        return f"no {path.name} (charts need matplotlib: pip install -e '.[plot]')"
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure = draw(plt)
    figure.tight_layout()
    with files.atomic(path) as out:
        figure.savefig(out.file, format="png", dpi=110)
    plt.close(figure)
    return path.name
