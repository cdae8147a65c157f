"""The GPU check's probes that need no ranks, on one GPU (the check runs each in a child process of its own):
each returns a ``Row`` that says what it proves, its figure, and whether it passed. Each fails when the bug
it names is put back; tests/test_gpu_probes.py puts each back on a CPU, with the CUDA part faked. The probes
that need ranks are in gpu_wrappers.py.

Modes are composed through Hydra (``composed``), as the trainer's are: ``mode=dp_functional`` is its YAML's
``dp_functional: true``, not the schema's default.
"""

from __future__ import annotations

import importlib
import threading
from importlib import resources

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn

from mnist_dist.config import Config
from mnist_dist.model import ConvNet
from mnist_dist.modes import wrap_model
from mnist_dist.parallel.dp import DataParallel, FunctionalDataParallel
from mnist_dist.parallel.state import OUTER
from mnist_dist.tools.gpu_check import Row
from mnist_dist.topology import kernel_policy

# The module nn.DataParallel calls parallel_apply through (torch.nn.parallel exports a function of that name).
torch_data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
FP32_TOLERANCE = 1e-5  # relative (norm of the error / norm of the float64 gradient): fp32 ~1e-7, TF32 ~1e-3


def composed(*overrides: str) -> Config:
    """The Config the trainer would run with these overrides."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


class ThreadProbe(nn.Module):
    """Records the dtype its linear layer computes in and the thread it ran in (replicas share the list).
    It keeps the thread itself: an ident is handed on to the next thread once its owner has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen: list[tuple[threading.Thread, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.seen.append((threading.current_thread(), y.dtype))
        return y


def _dtypes(seen: list[tuple[threading.Thread, torch.dtype]]) -> str:
    threads = {thread for thread, _ in seen}
    names = sorted({str(dtype).removeprefix("torch.") for _, dtype in seen})
    return f"{'/'.join(names)} in {len(threads)} threads"


def replica_dtype(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Row:
    """mode=``name``'s wrapper, as the trainer builds it, under autocast(``dtype``): its replicas' threads
    (two on one device: parallel_apply with devices [i, i]) against raw torch's parallel_apply. On CUDA the
    thread default is fp16, so bf16 shows the bug; on a CPU (a test) it is bf16, so the test asks for fp16."""
    mode = composed(f"mode={name}").mode
    probe = ThreadProbe().to(device)
    wrapped = wrap_model(probe, mode, device, 1)
    wrapper = next(m for m in wrapped.modules() if isinstance(m, OUTER))  # dp_block's is inside
    said = OmegaConf.load(resources.files("mnist_dist.conf") / "mode" / f"{name}.yaml")  # what the YAML says
    expected = FunctionalDataParallel if said.get("dp_functional", False) else DataParallel
    wrapper.device_ids = [device.index or 0] * 2  # two replicas' threads on this one device
    inputs = [(chunk,) for chunk in torch.randn(4, 8, device=device).chunk(2)]
    found = {}
    for who, apply in (("ours", wrapper.parallel_apply), ("raw torch", torch_data_parallel.parallel_apply)):
        probe.seen = []
        with torch.autocast(device.type, dtype=dtype):
            apply([probe, probe], inputs, None, *([] if who == "ours" else [wrapper.device_ids]))
        found[who] = probe.seen
    ours_ok = len({t for t, _ in found["ours"]}) == 2 and {d for _, d in found["ours"]} == {dtype}
    visible = {d for _, d in found["raw torch"]} != {dtype}  # torch's own bug shows: the probe can see it
    ok = ours_ok and visible and type(wrapper) is expected
    figure = (
        f"{type(wrapper).__name__}: {_dtypes(found['ours'])}; raw torch: {_dtypes(found['raw torch'])}"
        + ("" if visible else " (raw torch keeps the dtype too: this probe cannot see the bug)")
        + ("" if type(wrapper) is expected else f"; its YAML makes a {expected.__name__}")
    )
    proves = f"mode={name}'s replicas compute in the caller's {str(dtype).removeprefix('torch.')}"
    return Row(f"{name} replica dtype, amp, 2 threads on {device}", proves, figure, ok)


def _gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().cpu().double() for p in model.parameters()]


def _error(found: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(((f - r).norm() / r.norm()).item() for f, r in zip(found, reference))


def tf32_policy(device: torch.device) -> Row:
    """The convnet's fp32 gradients on ``device`` under the trainer's TF32 setting (default off), against
    float64 on the CPU: within fp32's tolerance; with TF32 on, outside it (the probe sees the difference)."""
    cfg = composed()
    torch.manual_seed(0)
    reference_model = ConvNet(dropout=False).double()
    x, y = torch.randn(64, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (64,))
    reference = _gradients(reference_model, x, y)
    errors = {}
    try:
        for tf32 in (cfg.tf32, True):
            kernel_policy(cfg.deterministic, tf32)  # what setup_process sets in every training process
            model = ConvNet(dropout=False).to(device)
            model.load_state_dict(reference_model.state_dict())  # copied into fp32
            errors[tf32] = _error(_gradients(model, x.float().to(device), y.to(device)), reference)
    finally:
        kernel_policy(cfg.deterministic, cfg.tf32)
    ok = errors[cfg.tf32] <= FP32_TOLERANCE < errors[True]
    figure = (
        f"tf32={str(cfg.tf32).lower()}: {errors[cfg.tf32]:.1e} from float64; tf32=true: {errors[True]:.1e} "
        f"(tolerance {FP32_TOLERANCE:g}; random images)"
    )
    return Row(f"TF32 policy, convnet gradients on {device}", "the trainer's fp32 is full fp32", figure, ok)
