"""What machine a number came from: throughput depends on it more than on anything in this repository, so every
results.json, bench.json and compare.json records ``describe()``, and every table of the tools names it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# bf16 autocast pays off on a CPU only with AVX-512 BF16 or AMX's bf16 matmul; else torch emulates it.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def describe() -> dict:
    """This machine, as plain JSON-ready fields."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = {}  # the first processor's
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    info = {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": [flag for flag in BF16_FLAGS if flag in fields.get("flags", "").split()],
        # The vector kernels torch picked (AVX2, AVX512, ...): they set how sums round, so a
        # deterministic run repeats bit for bit only on machines where this is the same.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count(),
    }
    # Naming the GPU initialises CUDA (a context of hundreds of MiB): only a process that computes on it does.
    if torch.cuda.is_initialized():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return info


def load_warning(load_average: float, cores: int | None = None) -> str | None:
    """One line when more work than ``cores`` (this machine's) competed while speeds were measured, else None."""
    cores = cores or os.cpu_count() or 1
    if load_average > cores:
        return (
            f"warning: the load average reached {load_average:.1f} on {cores} cores (these runs' own threads count "
            "too): more work than cores competed, so images/s is unreliable (loss and accuracy are not affected)"
        )
    return None
