"""What every check shares: the model as the trainer builds it, random batches, one step, a report line."""

from __future__ import annotations

import torch
from torch import nn

from mnist_dist.config import Config
from mnist_dist.model import instantiate_model
from mnist_dist.step import Precision, compute_gradients

RANKS = 2
BATCH = 8  # images per rank and step: enough for BatchNorm statistics, a second on a CPU

Line = tuple[str, str, str]  # status (OK, WARN, FAIL, SKIP), check, why


def build(cfg: Config) -> nn.Module:
    """The model the trainer would build: same seed, so the same weights on every rank."""
    torch.manual_seed(cfg.seed)
    return instantiate_model(cfg.model)


def random_batch(seed: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward in train mode, the trainer's own (DDP wrappers average inside backward)."""
    model.train()
    model.zero_grad(set_to_none=True)
    compute_gradients(model, x, y, Precision("off", x.device))


def names(items: list[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")
