"""What machine a number came from: the CPU and its bf16 flags, cores and threads, memory, torch, GPUs.

Throughput depends on the machine more than on anything in this repository (bf16 autocast is 0.9x
fp32 on one 2-core CPU and 1.4-1.8x on another with ``avx512_bf16``), so every results.json,
bench.json and compare.json records ``describe()`` and every table prints ``summary_line()``.
"""

from __future__ import annotations

import glob
import os
import platform
from pathlib import Path

import torch

# The CPU flags that decide whether bf16 autocast can pay off on a CPU: AVX-512 BF16 instructions,
# and AMX tiles (Sapphire Rapids and later) with their bf16 matrix multiply.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def native_bf16(cpu_flags: list[str]) -> bool:
    """Whether a CPU with these flags computes bf16 in hardware; without avx512_bf16 or amx_bf16 torch
    emulates it, several times slower than fp32 (0.14x on a 2-core EPYC)."""
    return "avx512_bf16" in cpu_flags or "amx_bf16" in cpu_flags


def _field(text: str, key: str) -> str:
    """The value of the first ``key: value`` line of a /proc file's text, else ""."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""


def _cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) from the text of /proc/cpuinfo (first processor)."""
    return _field(text, "model name"), set(_field(text, "flags").split())


def meminfo_kib(key: str) -> int:
    """A figure of /proc/meminfo (MemTotal, MemAvailable) in KiB; 0 where there is none."""
    return int((_field(_read("/proc/meminfo"), key) or "0").split()[0])


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:  # not Linux: the fields fall back to what platform knows
        return ""


def describe() -> dict:
    """This machine, as plain JSON-ready fields."""
    model, flags = _cpuinfo(_read("/proc/cpuinfo"))
    info = {
        "cpu": model or platform.processor() or platform.machine(),
        "cpu_flags": [flag for flag in BF16_FLAGS if flag in flags],  # empty: none of them
        # The vector kernels torch picked (AVX2, AVX512, ...): they set how sums round, so a
        # deterministic run repeats bit for bit only on machines where this is the same.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(meminfo_kib("MemTotal") / 2**20, 1),
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count(),
    }
    if info["gpus"]:
        info.update(gpu=_gpu_name(), cuda=torch.version.cuda, driver=_nvidia_driver())
    return info


def _gpu_name() -> str:
    """cuda:0's model. torch.cuda.get_device_name() initialises CUDA (a context, hundreds of MiB of GPU
    memory) in the process that asks: a CPU rank on a GPU host reads the driver's own files instead."""
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name(0)
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):  # by PCI address, as CUDA's order
        if model := _field(_read(path), "Model"):
            return model
    return "unknown"


def _nvidia_driver() -> str:
    # The kernel module reports its version here; no nvidia-smi subprocess needed.
    for word in _read("/proc/driver/nvidia/version").split():
        if word[:1].isdigit() and "." in word:
            return word
    return "unknown"


def summary_line(info: dict) -> str:
    """One line for the top of a table: ``machine: AMD EPYC (no avx512_bf16/amx), 2 cores, ...``."""
    flags = ", ".join(info["cpu_flags"]) or "no " + "/".join(BF16_FLAGS)
    line = (
        f"machine: {info['cpu']} ({flags}; torch {info['cpu_capability']} kernels), {info['cores']} cores, "
        f"{info['torch_threads']} torch threads, {info['memory_gib']:g} GiB, torch {info['torch']}"
    )
    if info.get("gpus"):
        line += f", {info['gpus']} x {info['gpu']} (CUDA {info['cuda']}, driver {info['driver']})"
    return line


def load_warning(load_average: float, cores: int | None = None) -> str | None:
    """One line when more work than ``cores`` (this machine's) competed while speeds were measured, else None."""
    cores = cores or os.cpu_count() or 1
    if load_average <= cores:
        return None
    return (
        f"warning: the load average reached {load_average:.1f} on {cores} cores (these runs' own threads count "
        "too): more work than cores competed, so images/s is unreliable (loss and accuracy are not affected)"
    )
