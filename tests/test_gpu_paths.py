"""The CUDA-only paths, checked on a CPU: device discovery faked, thread-local autocast, stream clocks,
process setup's flags and arguments (issue 26: every path a desk check found wrong on GPUs)."""

import importlib
import threading

import pytest
import torch
from torch import nn

from mnist_dist.model import ConvNet
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.parallel import dp as our_dp

DP_MODES = ["dp", "dp_block", "dp_functional"]
# The module, not the function torch.nn.parallel exports under the same name.
torch_data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")


@pytest.fixture
def four_gpus(monkeypatch):
    """What torch and nn.DataParallel see on a machine with 4 GPUs; nothing runs on them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_data_parallel, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(torch_data_parallel, "_get_all_device_indices", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(torch_data_parallel, "_check_balance", lambda device_ids: None)


@pytest.mark.parametrize("name", DP_MODES)
def test_dp_on_the_cpu_uses_no_gpu_where_gpus_are_visible(four_gpus, name):
    # nn.DataParallel(device_ids=None) means every visible GPU: 4 GPUs crashed, 1 trained on cuda:0.
    torch.manual_seed(0)
    plain = ConvNet(dropout=False)
    model = ConvNet(dropout=False)
    model.load_state_dict(plain.state_dict())
    options = {"dp_block": {"dp_block": "features"}, "dp_functional": {"dp_functional": True}}.get(name, {})
    wrapped = wrap_model(model, MODES[name].schema(name=name, **options), torch.device("cpu"), gpus=4)
    assert [m.device_ids for m in wrapped.modules() if hasattr(m, "device_ids")] == [[]]
    assert {p.device for p in wrapped.parameters()} == {torch.device("cpu")}
    x = torch.randn(8, 1, 28, 28)
    torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)


def threaded_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply as far as autocast goes, with the CPU standing in for CUDA: one thread per
    replica, which re-enters autocast with the caller's on/off and no dtype (the dtype is thread-local)."""
    enabled, results = torch.is_autocast_enabled("cpu"), {}

    def worker(i, module, args):
        with torch.amp.autocast("cpu", enabled=enabled):
            results[i] = module(*args)

    threads = [threading.Thread(target=worker, args=(i, m, a)) for i, (m, a) in enumerate(zip(modules, inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(modules))]


def test_a_new_thread_does_not_inherit_the_autocast_dtype():
    # The bug of issue 26 item 2 in torch itself: the reason the wrappers pass the dtype on.
    with torch.autocast("cpu", dtype=torch.float16):
        (out,) = threaded_parallel_apply([nn.Linear(4, 4)], [(torch.randn(2, 4),)])
    assert out.dtype == torch.bfloat16  # the CPU's default autocast dtype, not the caller's fp16


@pytest.mark.parametrize("functional", [False, True])
def test_replicas_compute_in_the_callers_autocast_dtype(monkeypatch, functional):
    # On CUDA the caller's bf16 became the thread's default fp16, without a GradScaler. Here the CPU
    # stands in: its thread default is bf16, so the caller asks for fp16.
    monkeypatch.setattr(our_dp, "parallel_apply", threaded_parallel_apply)
    monkeypatch.setattr(torch_data_parallel, "parallel_apply", threaded_parallel_apply)  # the old path too
    linear, x = nn.Linear(4, 4), torch.randn(4, 4)
    if functional:
        monkeypatch.setattr(our_dp, "scatter", lambda tensor, ids: tensor.chunk(len(ids)))
        monkeypatch.setattr(our_dp, "replicate", lambda module, ids: [module] * len(ids))
        monkeypatch.setattr(our_dp, "gather", lambda outputs, device: outputs)  # each replica's, as it made it
        wrapper = our_dp.FunctionalDataParallel(linear, [0, 1])
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = wrapper(x)
    else:
        monkeypatch.setattr(torch_data_parallel, "_get_available_device_type", lambda: "cpu")
        wrapper = our_dp.data_parallel(linear, [0, 1], "", functional=False)
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = wrapper.parallel_apply([linear, linear], [(x[:2],), (x[2:],)], None)
    assert [out.dtype for out in outputs] == [torch.float16] * len(outputs)
