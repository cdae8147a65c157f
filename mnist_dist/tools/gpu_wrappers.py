"""The GPU check's checks that wrap models directly instead of running the trainer: the dtype dp's
replicas compute in under autocast, and the gradients of our DDP and torch DDP against one process."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.model import ConvNet
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.parallel import DistributedDataParallel, spawn
from mnist_dist.precision import Precision
from mnist_dist.step import compute_gradients
from mnist_dist.topology import fp32_precision

GRADIENT_TOLERANCE = 1e-5  # absolute, our DDP and torch DDP against one process on the global batch
GRADIENT_BATCH = 32


class Probe(torch.nn.Module):
    """Records the dtype its linear layer computes in, per device: replicate() shares the dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.seen[str(x.device)] = y.dtype
        return y


def check_replica_dtype(failed: list[str]) -> dict[str, str]:
    """dp and functional dp on 2 GPUs under amp=bf16: the dtype each replica's thread computed in."""
    found = {}
    for name in ("dp", "dp_functional"):
        probe = Probe()
        model = wrap_model(probe, MODES[name].schema(name=name), torch.device("cuda:0"), 2)
        with Precision("bf16", torch.device("cuda:0")).autocast():
            model(torch.randn(4, 8, device="cuda:0"))
        found[name] = ", ".join(
            f"{str(dtype).split('.')[-1]} on {device}" for device, dtype in sorted(probe.seen.items())
        )
        if len(probe.seen) != 2 or set(probe.seen.values()) != {torch.bfloat16}:
            failed.append(f"{name}: replicas under amp=bf16 computed in {found[name]}; all must be bfloat16")
    return found


def gradient_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GRADIENT_BATCH, 1, 28, 28, generator=generator)
    return x.to(device), torch.randint(0, 10, (GRADIENT_BATCH,), generator=generator).to(device)


def gradients(model: torch.nn.Module, wrapped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    for _ in range(2):  # our DDP: the first backward records the bucket plan, the second runs on it
        model.zero_grad(set_to_none=True)
        compute_gradients(wrapped, x, y, Precision("off", x.device))
    return {name: p.grad.detach().cpu() for name, p in model.named_parameters()}


# at module level: spawn's fresh processes import it by name
def gradient_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    """Both wrappers on this rank's half of the batch; every rank on the same device (cuda:0 or cpu)."""
    fp32_precision(tf32=False)  # TF32 convolutions would differ by more than the tolerance
    dist.init_process_group("gloo")  # gloo all-reduces CUDA tensors too: two ranks can share one GPU
    device = torch.device("cuda:0" if device_type == "cuda" else "cpu")
    x, y = (t.chunk(world_size)[rank] for t in gradient_batch(device))
    found = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("torch_ddp", TorchDDP)):
        torch.manual_seed(0)
        model = ConvNet(dropout=False).to(device)
        found[name] = gradients(model, wrap(model), x, y)
    torch.save(found, os.path.join(out, f"gradients_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def check_gradients(device_type: str, work: Path, failed: list[str]) -> dict[str, float]:
    """Largest gradient difference of each wrapper (2 ranks) from one process on the whole batch."""
    device = torch.device("cuda:0" if device_type == "cuda" else "cpu")
    fp32_precision(tf32=False)
    torch.manual_seed(0)
    model = ConvNet(dropout=False).to(device)
    expected = gradients(model, model, *gradient_batch(device))
    spawn(gradient_worker, 2, device_type, str(work))
    worst = {}
    for rank in range(2):
        for name, found in torch.load(work / f"gradients_{rank}.pt").items():
            difference = max((found[key] - expected[key]).abs().max().item() for key in expected)
            worst[name] = max(worst.get(name, 0.0), difference)
    for name, difference in worst.items():
        if difference > GRADIENT_TOLERANCE:
            failed.append(f"{name}: gradients differ from one process by {difference:.1e} (> {GRADIENT_TOLERANCE:g})")
    return worst
