"""Each row of the GPU check fails when its bug is put back, and passes on today's code: the probes run on a
CPU, with the CUDA part faked (threads for parallel_apply, a cuDNN that honours the TF32 flag, stubbed NCCL)."""

import time

import pytest
import torch
from helpers import threaded_parallel_apply
from torch import nn

from mnist_dist import step, topology
from mnist_dist.parallel import DistributedDataParallel
from mnist_dist.parallel import dp as our_dp
from mnist_dist.parallel.ddp import Bucket
from mnist_dist.tools import gpu_probes

CPU = torch.device("cpu")


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


def one_thread_after_another(modules, inputs, kwargs_tup=None, devices=None):
    """threaded_parallel_apply with each thread joined before the next starts: a finished thread's ident
    is given to the next one (CPython reuses them), so the probe must tell threads apart by more."""
    outputs = []
    for module, args in zip(modules, inputs):
        outputs += threaded_parallel_apply([module], [args])
    return outputs


def test_replica_dtype_row_counts_threads_that_ran_one_after_another(monkeypatch):
    monkeypatch.setattr(our_dp, "parallel_apply", one_thread_after_another)
    monkeypatch.setattr(gpu_probes.torch_data_parallel, "parallel_apply", one_thread_after_another)
    for _ in range(5):  # each try reuses the ident with some chance; five make the old count fail
        row = gpu_probes.replica_dtype("dp_functional", CPU, torch.float16)
        assert row.figure == "FunctionalDataParallel: float16 in 2 threads; raw torch: bfloat16 in 2 threads"


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


# ddp overlap: a backward long enough to hide the first bucket, all-reduces stubbed with known durations ----
class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.5)  # the backward compute after the first bucket is sent: a lower bound under any load
        return grad


class SlowNet(nn.Module):
    """fc2 (1 MiB: the first bucket, sent first) after a backward of 0.5 s that fc1's small bucket waits for."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 512), nn.Linear(512, 512)

    def forward(self, x):
        return self.fc2(SlowBackward.apply(self.fc1(x)))


@pytest.fixture
def timed_all_reduce(monkeypatch):
    """all_reduce as a link that sends one tensor after another: 0.3 s per MiB, done at its own pace."""
    busy_until = [0.0]

    class Work:
        def __init__(self, tensor):
            busy_until[0] = max(time.monotonic(), busy_until[0]) + 0.3 * tensor.numel() * 4 / 2**20
            self.done = busy_until[0]

        def wait(self, timeout=None):
            time.sleep(max(0.0, self.done - time.monotonic()))
            return True

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *args, **kwargs: Work(tensor))


def overlap_on_and_off():
    x, y = torch.randn(8, 4), torch.randint(0, 10, (8,))
    waits = [gpu_probes.exposed_wait_ms(on, SlowNet(), x, y, steps=1, warmup=2) for on in (True, False)]
    return gpu_probes.overlap_row(*waits, "1 stubbed rank")


@pytest.mark.slow
def test_overlap_row_passes_when_backward_hides_the_first_bucket(one_rank, timed_all_reduce):
    row = overlap_on_and_off()
    assert row.ok, row


@pytest.mark.slow
def test_overlap_row_fails_when_buckets_wait_for_the_end_of_backward(one_rank, timed_all_reduce, monkeypatch):
    # The bug: nothing sent while backward runs, although overlap=true (comm_wait > 0 passed on this too).
    launch = DistributedDataParallel._launch_ready_buckets
    monkeypatch.setattr(
        DistributedDataParallel,
        "_launch_ready_buckets",
        lambda self, everything=False: everything and launch(self, True),
    )
    row = overlap_on_and_off()
    assert not row.ok, row


def test_overlap_is_judged_only_where_each_rank_has_a_gpu_of_its_own():
    # Two ranks time-slicing one GPU can leave either's all-reduce exposed with nothing broken.
    report = {"on": 0.9, "off": 1.0}
    shared = gpu_probes.overlap_report_row({**report, "own": False}, "cuda")
    assert shared.ok and shared.figure.endswith("(not judged: 2 ranks time-slice one GPU)")
    assert gpu_probes.overlap_report_row({**report, "own": False}, "cpu").ok
    own = gpu_probes.overlap_report_row({**report, "own": True}, "cuda")
    assert not own.ok and own.name == "ddp overlap, 2 gloo ranks, a GPU each"


# BatchNorm evaluation, both DDPs' gradients: 2 CPU ranks, forked so that the bug put back reaches them -----
@pytest.mark.slow
def test_batchnorm_row_passes_on_two_ranks(tmp_path):
    report = gpu_probes.ranks(gpu_probes.batchnorm_worker, "cpu", tmp_path, start_method="fork")
    row = gpu_probes.batchnorm_row(report, tmp_path, "cpu")
    assert row.ok, row


@pytest.mark.slow
def test_batchnorm_row_fails_when_evaluation_skips_rank_0s_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "buffers_from_rank0", lambda model: None)  # each rank evaluates its own statistics
    report = gpu_probes.ranks(gpu_probes.batchnorm_worker, "cpu", tmp_path, start_method="fork")
    row = gpu_probes.batchnorm_row(report, tmp_path, "cpu")
    assert not row.ok, row


def test_gradient_rows_pass_on_two_ranks(tmp_path):
    report = gpu_probes.ranks(gpu_probes.gradient_worker, "cpu", tmp_path, start_method="fork")
    rows = gpu_probes.gradient_rows(report, "cpu")
    assert [row.ok for row in rows] == [True, True], rows


def test_gradient_rows_fail_when_our_ddp_sums_instead_of_averaging(tmp_path, monkeypatch):
    send = Bucket.send
    monkeypatch.setattr(Bucket, "send", lambda self, params, scale: send(self, params, 1.0))
    report = gpu_probes.ranks(gpu_probes.gradient_worker, "cpu", tmp_path, start_method="fork")
    assert [row.ok for row in gpu_probes.gradient_rows(report, "cpu")] == [False, True]


# NCCL: stubbed by gloo, bound to a stand-in device where init_process_group is given device_id ----------------
@pytest.fixture
def stubbed_nccl(monkeypatch, tmp_path):
    """One GPU seen, CUDA calls recorded, init_process_group run as gloo on a file store; the group is bound
    (to the CPU, standing in for the GPU) where it is given device_id, as NCCL's is."""
    init = torch.distributed.init_process_group
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)

    def fake(backend, store=None, rank=0, world_size=1, timeout=None, device_id=None):
        assert backend == "nccl"
        init("gloo", init_method=f"file://{tmp_path}/store", rank=rank, world_size=world_size)
        if device_id is not None:
            torch.distributed.group.WORLD.bound_device_id = torch.device("cpu", 0)

    monkeypatch.setattr(torch.distributed, "init_process_group", fake)
    return fake


def test_nccl_row_passes_when_process_setup_binds_the_device(stubbed_nccl):
    row = gpu_probes.nccl_row(gpu_probes.nccl_binding("cuda"))
    assert row.ok and row.figure == "bound to cpu:0; barrier warnings: 0", row


def test_nccl_row_fails_without_device_id(stubbed_nccl, monkeypatch):
    unbound = lambda backend, **kwargs: stubbed_nccl(backend, **{k: v for k, v in kwargs.items() if k != "device_id"})  # noqa: E731
    monkeypatch.setattr(torch.distributed, "init_process_group", unbound)
    row = gpu_probes.nccl_row(gpu_probes.nccl_binding("cuda"))
    assert not row.ok and row.figure.startswith("bound to None"), row
