"""Each row of the GPU check fails when its bug is put back, and passes on today's code: the probes run on a
CPU, with the CUDA part faked (threads for parallel_apply, a cuDNN that honours the TF32 flag, stubbed NCCL)."""

import threading

import pytest
import torch

from mnist_dist import topology
from mnist_dist.parallel import dp as our_dp
from mnist_dist.tools import gpu_probes

CPU = torch.device("cpu")


def threaded_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply as far as autocast goes, the CPU standing in for CUDA: a thread per replica,
    which re-enters autocast with the caller's on/off and no dtype (the dtype is thread-local)."""
    enabled, results = torch.is_autocast_enabled("cpu"), {}

    def worker(i, module, args):
        with torch.autocast("cpu", enabled=enabled):
            results[i] = module(*args)

    threads = [threading.Thread(target=worker, args=(i, m, a)) for i, (m, a) in enumerate(zip(modules, inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(modules))]


@pytest.fixture
def threads_for_devices(monkeypatch):
    monkeypatch.setattr(our_dp, "parallel_apply", threaded_parallel_apply)
    monkeypatch.setattr(gpu_probes.torch_data_parallel, "parallel_apply", threaded_parallel_apply)


@pytest.mark.parametrize("name", ["dp", "dp_functional"])
def test_replica_dtype_row_passes_and_sees_raw_torchs_bug(threads_for_devices, name):
    # The CPU's thread default is bf16, so the caller's fp16 is what a new thread loses here.
    row = gpu_probes.replica_dtype(name, CPU, torch.float16)
    assert row.ok, row
    wrapper = "FunctionalDataParallel" if name == "dp_functional" else "DataParallel"
    assert row.figure == f"{wrapper}: float16 in 2 threads; raw torch: bfloat16 in 2 threads"


@pytest.mark.parametrize("name", ["dp", "dp_functional"])
def test_replica_dtype_row_fails_with_the_dtype_lost_in_the_threads(threads_for_devices, monkeypatch, name):
    monkeypatch.setattr(our_dp, "in_callers_autocast", lambda replicas, device_type: replicas)  # the old code
    row = gpu_probes.replica_dtype(name, CPU, torch.float16)
    assert not row.ok and "bfloat16 in 2 threads; raw torch" in row.figure


def test_replica_dtype_row_fails_where_the_mode_is_built_from_its_schema(threads_for_devices, monkeypatch):
    # The old check built each mode from its schema, whose dp_functional is False: plain DataParallel.
    from mnist_dist.modes import MODES

    class Schema:
        mode = MODES["dp_functional"].schema(name="dp_functional")

    monkeypatch.setattr(gpu_probes, "composed", lambda *overrides: Schema)
    row = gpu_probes.replica_dtype("dp_functional", CPU, torch.float16)
    assert not row.ok and row.figure.startswith("DataParallel:")


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` with TF32's 10-bit mantissa (truncated), the gradient passed straight through."""
    rounded = (x.detach().view(torch.int32) & ~0x1FFF).view(torch.float32)
    return x + (rounded - x).detach()


@pytest.fixture
def cudnn_honours_tf32(monkeypatch):
    """conv2d as cuDNN computes it: fp32 inputs rounded to TF32 where the flag says tf32."""
    conv2d = torch.nn.functional.conv2d

    def fake(input, weight, *args, **kwargs):
        if input.dtype == torch.float32 and torch.backends.cudnn.conv.fp32_precision == "tf32":
            input, weight = tf32_rounded(input), tf32_rounded(weight)
        return conv2d(input, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.modules.conv.F, "conv2d", fake)
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch 2.14's default for convolutions on a GPU


def test_tf32_row_passes_with_the_trainers_policy(cudnn_honours_tf32):
    row = gpu_probes.tf32_policy(CPU)
    assert row.ok, row
    assert row.figure.startswith("tf32=false: ") and "; tf32=true: " in row.figure


def test_tf32_row_fails_where_process_setup_leaves_torchs_default(cudnn_honours_tf32, monkeypatch):
    monkeypatch.setattr(topology, "fp32_precision", lambda tf32: None)  # the bug: TF32 convolutions unasked
    row = gpu_probes.tf32_policy(CPU)
    assert not row.ok, row


def test_a_probe_that_raises_is_a_failed_row():
    def probe():
        raise RuntimeError("CUDA error: out of memory\nmore")

    row = gpu_probes.timed(probe)
    assert not row.ok and row.figure == "raised RuntimeError: CUDA error: out of memory"
