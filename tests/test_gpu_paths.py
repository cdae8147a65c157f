"""The CUDA-only paths, checked on a CPU: device discovery faked, stream clocks, process setup's flags. What
needs a real GPU: the GPU check's probes (test_gpu_probes.py)."""

import importlib
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import validate_here

from mnist_dist import metrics
from mnist_dist.config import ConfigError
from mnist_dist.model import ConvNet
from mnist_dist.modes import MODES, DDPMode, wrap_model
from mnist_dist.operations import checkpoint
from mnist_dist.topology import Topology, from_env, setup_process

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


def test_dp_on_the_cpu_uses_no_gpu_where_gpus_are_visible(four_gpus):
    # nn.DataParallel(device_ids=None) means every visible GPU: 4 GPUs crashed, 1 trained on cuda:0. The device
    # ids are chosen once for the three dp modes.
    torch.manual_seed(0)
    plain = ConvNet(dropout=False)
    model = ConvNet(dropout=False)
    model.load_state_dict(plain.state_dict())
    wrapped = wrap_model(model, MODES["dp"].schema(name="dp"), torch.device("cpu"), gpus=4)
    assert [m.device_ids for m in wrapped.modules() if hasattr(m, "device_ids")] == [[]]
    assert {p.device for p in wrapped.parameters()} == {torch.device("cpu")}
    x = torch.randn(8, 1, 28, 28)
    torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)


def test_compile_is_refused_only_with_dp_on_several_gpus(make_config, monkeypatch):
    # model.compile() binds the compiled call to the module; replicate() copies __dict__, so every
    # replica would run cuda:0's weights. The rule reads the schema that dp_block and dp_functional share.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="compile=true with mode=dp on 2 GPUs"):
        validate_here(make_config("mode=dp", "gpus=2", "device=cuda", "compile=true"))
    for allowed in (["gpus=1", "device=cuda"], ["gpus=2", "device=cpu"]):
        validate_here(make_config("mode=dp", *allowed, "compile=true"))
    # Our DDP computes the same with a compiled model; its buckets then all go at the compiled backward's end.
    validate_here(make_config("mode=ddp", "gpus=2", "compile=true"))


def test_the_clocks_read_once_the_compute_stream_of_every_device_is_done(monkeypatch):
    # dp on two GPUs: a replica still running on cuda:1 is in the interval too
    synced = []
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device: SimpleNamespace(synchronize=lambda: synced.append(device))
    )
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    clock = metrics.Stopwatch(devices)
    clock.start()
    clock.stop()
    assert synced == devices * 2 and clock.seconds > 0


def test_the_devices_of_a_process():
    two = [torch.device("cuda:0"), torch.device("cuda:1")]
    assert Topology("dp", "cuda", 1, gpus=2).devices == two
    assert Topology("split", "cuda", 1, gpus=4).devices == two  # split uses at most 2
    assert Topology("split", "cuda", 1, gpus=1).devices == [torch.device("cuda:0")]  # and the CPU
    assert Topology("ddp", "cuda", 2, gpus=2, rank=1, local_rank=1).devices == [torch.device("cuda:1")]
    assert Topology("dp", "cpu", 1, gpus=2).devices == [torch.device("cpu")]


def test_a_checkpoint_keeps_the_random_state_of_every_cuda_device(monkeypatch):
    # dp's replicas draw dropout masks on every GPU: cuda:0's state alone does not resume bit for bit.
    states = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda new: restored.extend(new))
    (saved,) = checkpoint.rng_states_of_all_ranks()
    assert saved["cuda"] == states
    checkpoint.restore_rng([saved], rank=0)
    assert restored == states


@pytest.mark.parametrize("tf32", [False, True])
def test_setup_sets_the_tf32_policy_for_convolutions_and_matmuls(tf32):
    # torch 2.14 runs fp32 cuDNN convolutions in TF32 by default: exact comparisons on a GPU need it off.
    setup_process(Topology("single", "cpu", 1, gpus=1), deterministic=True, timeout_s=60, tf32=tf32)
    precision = "tf32" if tf32 else "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == precision
    assert torch.backends.cuda.matmul.fp32_precision == precision
    # torch's own code (inductor) still reads the legacy flags: they must say the same, not raise.
    assert torch.backends.cudnn.allow_tf32 is tf32 and torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")


def test_an_srun_task_finds_its_gpu_and_device_cuda_without_one_is_an_error(make_config, monkeypatch):
    # This process as task 1 of ``srun --ntasks=4 --ntasks-per-node=4``.
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODELIST": "node1"}
    slurm |= {"SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    ddp = ("mode=ddp", "gpus=4", "device=cuda")
    # --gpus-per-task=1: each task sees its own GPU as cuda:0; SLURM_LOCALID is not a device index.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    found = from_env(make_config(*ddp))
    assert (found.rank, found.local_rank, found.device) == (1, 1, torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # every task sees the node's GPUs
    assert from_env(make_config(*ddp)).device == torch.device("cuda:1")
    # from_env's one device check, whichever launcher (torchrun, srun) set the variables
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="device=cuda but no CUDA device is visible; use device=cpu or device=auto"):
        from_env(make_config(*ddp))
    assert from_env(make_config("mode=ddp", "gpus=4", "device=auto")).device == torch.device("cpu")


def test_cublas_gets_its_fixed_workspace_before_anything_can_use_cuda():
    # cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, at its first use in a process: importing the package is
    # the first thing any of its processes does
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_model_state_counts_both_ddps_alike_with_gradients_as_bucket_views(one_rank):
    # Each storage once: a .grad that is a view of its bucket is not counted twice, nor the buckets (torch's
    # are not public), so both DDPs report the same figure. Without views, in a run: test_world_size.py.
    figures = {}
    for name in ("ddp", "torch_ddp"):
        torch.manual_seed(0)
        options = DDPMode(name, bucket_cap_mb=25.0, gradient_as_bucket_view=True)
        model = wrap_model(ConvNet(dropout=False), options, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 1, 28, 28)).sum().backward()
            optimizer.step()
        figures[options.name] = metrics.state_bytes(model, optimizer)
    weights = 4 * sum(p.numel() for p in ConvNet().parameters())
    assert figures == dict.fromkeys(("ddp", "torch_ddp"), weights * 3)  # fp32 weights, gradients, momentum
