"""Each probe of the GPU check fails when its bug is put back, and passes on today's code: on a CPU, with the CUDA
part faked (threads for parallel_apply, gloo for NCCL)."""

import pytest
import torch
from helpers import threaded_parallel_apply

from mnist_dist.parallel import dp as our_dp
from mnist_dist.tools import gpu_check


@pytest.mark.parametrize("name", ["dp", "dp_functional"])
@pytest.mark.parametrize("bug", [False, True])
def test_replica_dtype_row_fails_with_the_dtype_lost_in_the_threads(monkeypatch, name, bug):
    # The CPU's thread default is bf16, so the caller's fp16 is what a new thread loses here.
    monkeypatch.setattr(our_dp, "parallel_apply", threaded_parallel_apply)
    monkeypatch.setattr(gpu_check.torch_data_parallel, "parallel_apply", threaded_parallel_apply)
    if bug:  # the old code: replicas run as they are
        monkeypatch.setattr(our_dp, "in_callers_autocast", lambda replicas, device_type: replicas)
    row = gpu_check.replica_dtype(name, torch.device("cpu"), torch.float16)
    assert row.ok is not bug, row
    assert ("bfloat16 in 2 threads; raw torch" if bug else "float16 in 2 threads; raw torch: bfloat16") in row.figure


@pytest.mark.parametrize("device_id", [True, False])
def test_nccl_row_fails_without_device_id(monkeypatch, tmp_path, device_id):
    # NCCL stood in for by gloo on a file store, bound (to the CPU) where it is given device_id, as NCCL's is.
    init = torch.distributed.init_process_group
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def nccl(backend, init_method=None, store=None, rank=0, world_size=1, timeout=None, device_id=None):
        init("gloo", init_method=f"file://{tmp_path}/store", rank=rank, world_size=world_size)
        if device_id is not None:
            torch.distributed.group.WORLD.bound_device_id = torch.device("cpu", 0)

    unbound = lambda backend, device_id=None, **kwargs: nccl(backend, **kwargs)  # noqa: E731  the bug put back
    monkeypatch.setattr(torch.distributed, "init_process_group", nccl if device_id else unbound)
    row = gpu_check.nccl_row("cuda")
    assert row.ok is device_id and row.figure.startswith("bound to cpu:0" if device_id else "bound to None"), row
