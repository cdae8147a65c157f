"""Training runs as the tools start them (``python -m mnist_dist`` with overrides, each in a fresh
process, on generated data for the benchmarks), and the arithmetic over their interleaved repeats."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from mnist_dist.tools.synthetic import write_idx


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
    """``python -m mnist_dist <overrides>`` in a fresh process writing to ``run_dir``, without a bar, killed
    with its ranks after ``timeout`` seconds; its results.json. A failed run raises RuntimeError with its exit
    status and last error line, or that it timed out."""
    command = [sys.executable, "-m", "mnist_dist", *overrides, "progress=false", f"hydra.run.dir={run_dir}"]
    result = bounded(command, timeout)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no error output"])[-1]
        raise RuntimeError(f"exit {result.returncode}: {last}")
    return json.loads((run_dir / "results.json").read_text())


def run_trainer(name: str, overrides: list[str], work: Path, settings: dict, round_: int) -> dict:
    """``python -m mnist_dist <overrides>`` on the bench's data and settings (runs/<name>_<round_>); its numbers."""
    where = [f"gpus={settings['gpus']}", f"device={settings['device']}", f"data.root={work / 'data'}"]
    shape = ["data.mirrors=[]", "epochs=1", f"batch_size={settings['batch']}", f"warmup_steps={settings['warmup']}"]
    try:
        results = train_in_subprocess([*overrides, *where, *shape], work / "runs" / f"{name}_{round_}")
    except RuntimeError as error:
        sys.exit(f"bench: {name} failed: {error}")
    return {
        "images_per_s": results["train_images_per_s"],
        "peak_rss_mib": results["peak_rss_mib"],
        "model_state_mib": results["model_state_mib"],
        "step_time_ms": results["step_time_ms"],
        "ddp_backward_ms": results["ddp_backward_ms"],
        "torch_threads": results["machine"]["torch_threads"],  # per rank: ddp ranks share the cores
    }


def write_data(work: Path, settings: dict) -> None:
    """Generated MNIST-format data in ``work``: one epoch is warm-up + timed steps (+ the first step after
    warm-up, which the trainer's clock also skips)."""
    n_train = (settings["warmup"] + settings["steps"] + 1) * settings["batch"]
    write_idx(work / "data" / "MNIST" / "raw", n_train=n_train, n_test=500)


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def paired_ratio(case: list[float], baseline: list[float]) -> dict:
    """Median and range of the per-round ratios: round i of both ran back to back."""
    return summarize([a / b for a, b in zip(case, baseline)])


def median_counters(runs: list[dict]) -> dict[str, float] | None:
    """Each of the wrapper's backward counters, the median over the runs (None outside ddp modes)."""
    counters = [run["ddp_backward_ms"] for run in runs if run.get("ddp_backward_ms")]
    if not counters:
        return None
    return {name: statistics.median(c[name] for c in counters) for name in counters[0]}


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: how shared the machine was while this ran."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
