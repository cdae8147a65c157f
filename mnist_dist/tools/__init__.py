"""What people run beside the trainer, ``python -m mnist_dist.tools.<name>``: compare, bench, check, gpu_check,
offline_bundle (each says what it does). Below: what they share."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
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


def composed(*overrides: str):
    """The Config ``python -m mnist_dist <overrides>`` runs with (Hydra imported here: gpu_check starts without)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


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


def machine_line(info: dict) -> str:
    """One line for the top of a table: ``machine: AMD EPYC (no avx512_bf16/amx...), 2 cores, ...``."""
    from mnist_dist.operations.machine import BF16_FLAGS  # here: offline_bundle runs without torch

    flags = ", ".join(info["cpu_flags"]) or "no " + "/".join(BF16_FLAGS)
    line = (
        f"machine: {info['cpu']} ({flags}; torch {info['cpu_capability']} kernels), {info['cores']} cores, "
        f"{info['torch_threads']} torch threads, torch {info['torch']}"
    )
    return line + (f", {info['gpus']} x {info['gpu']} (CUDA {info['cuda']})" if info.get("gpu") else "")


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar a run logged, ``{tag: {step: value}}`` in step order, less what a later attempt purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})  # 0: every event, not a sample
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def write_idx(raw: Path, n_train: int = 640, n_test: int = 200, seed: int = 0) -> Path:
    """The four IDX files of small, learnable MNIST-format data in ``raw`` (class k: a bright square at spot k
    on noise), for what must train without downloading; returns ``raw``."""
    import torch  # here: the tools start (and offline_bundle runs) without it

    raw.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (torch.arange(n) % 10)[torch.randperm(n, generator=generator)]
        images = torch.randint(0, 96, (n, 28, 28), generator=generator, dtype=torch.uint8)
        for i, label in enumerate(labels.tolist()):
            row, col = divmod(label, 4)
            images[i, 2 + 8 * row : 8 + 8 * row, 2 + 7 * col : 7 + 7 * col] = 255
        image_bytes, label_bytes = images.numpy().tobytes(), labels.to(torch.uint8).numpy().tobytes()
        files.write(raw / f"{prefix}-images-idx3-ubyte", struct.pack(">IIII", 0x803, n, 28, 28) + image_bytes)
        files.write(raw / f"{prefix}-labels-idx1-ubyte", struct.pack(">II", 0x801, n) + label_bytes)
    return raw
