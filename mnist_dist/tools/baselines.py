"""The benchmark's two cases that are not the trainer, measured in a process of their own: ``classic``
(pytorch/examples mnist's DataLoader with per-sample transforms) and ``ceiling`` (forward + backward + step
on one resident batch, nothing else). ``python -m mnist_dist.tools.bench`` runs each through ``--measure``."""

from __future__ import annotations

import resource
from pathlib import Path

import torch

from mnist_dist.config import Config
from mnist_dist.metrics import state_bytes
from mnist_dist.parallel.timing import StreamClock
from mnist_dist.step import Precision, train_step
from mnist_dist.topology import kernel_policy


def measure_here(case: str, root: Path, batch: int, steps: int, warmup: int, device: torch.device) -> dict:
    """The two cases written in the benchmark itself, in this process, on ``device``, timed on the trainer's
    clock (its compute stream) and with the trainer's kernels (TF32 and determinism) chosen as the trainer
    does, so that their ratios to the trainer's cases compare the same device and arithmetic."""
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    from mnist_dist.model import ConvNet

    kernel_policy(Config.deterministic, Config.tf32)  # the trainer's defaults, which its cases run with
    torch.manual_seed(0)
    model = ConvNet().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    precision = Precision("off", device)
    if case == "classic":  # pytorch/examples mnist, as people write it: batches go to the device in the loop
        dataset = datasets.MNIST(
            str(root),
            train=True,
            download=False,
            transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]),
        )
        batches = iter(DataLoader(dataset, batch_size=batch, shuffle=True))
    else:
        resident = (torch.randn(batch, 1, 28, 28, device=device), torch.randint(0, 10, (batch,), device=device))
        batches = iter(lambda: resident, None)
    clock = StreamClock([device])
    for step in range(warmup + steps):
        if step == warmup:
            started = clock.now()
        x, y = next(batches)
        train_step(model, optimizer, x.to(device), y.to(device), precision)
    seconds = clock.seconds(started, clock.now())
    return {
        "images_per_s": steps * batch / seconds,
        "peak_rss_mib": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024],
        "model_state_mib": [state_bytes(model, optimizer) / 2**20],
        "torch_threads": torch.get_num_threads(),
    }
