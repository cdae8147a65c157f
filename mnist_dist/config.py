"""The configuration schema: every setting, declared once, with its default and why it exists.

Hydra merges the YAML files in ``conf/`` onto these dataclasses, so a misspelt key or a value of the
wrong type fails while the config is composed, before anything runs or is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

# Where datasets live unless data.root says otherwise; outside the run directory so that every run,
# and every clone, shares one copy.
DEFAULT_DATA_ROOT = "${oc.env:MNIST_DIST_DATA,'~/.cache/mnist_dist'}"

DISTRIBUTED_MODES = ("ddp", "torch_ddp")


@dataclass
class ModeConfig:
    name: str = "single"  # single | ddp | torch_ddp: how the model is replicated
    # ddp only. Elements per all-reduce bucket (10M elements = 40 MB of fp32, apex's default): smaller
    # buckets start communicating earlier in backward, larger ones send fewer messages.
    message_size: int = 10_000_000
    overlap: bool = True  # ddp: all-reduce while backward runs (false: only after it, for comparison)
    find_unused_parameters: bool = False  # ddp/torch_ddp: allow parameters that get no gradient


@dataclass
class DataConfig:
    name: str = "mnist"  # mnist | fashion_mnist
    root: str = DEFAULT_DATA_ROOT  # holds <root>/MNIST/raw, <root>/FashionMNIST/raw (torchvision layout)
    mirrors: list[str] = field(default_factory=list)  # URLs, file:// URLs or directories, tried in order
    mean: float = 0.1307  # per-pixel normalisation of the training set
    std: float = 0.3081


@dataclass
class OptimConfig:
    name: str = "Adadelta"  # a class in torch.optim
    lr: float = 1.0
    gamma: float = 0.7  # StepLR factor applied after every epoch, as in pytorch/examples mnist


@dataclass
class DistConfig:
    port: int = 0  # rendezvous port on 127.0.0.1 for spawned workers; 0 picks a free one
    timeout_s: int = 300  # a collective that waits longer than this fails instead of hanging


@dataclass
class Config:
    mode: ModeConfig = field(default_factory=ModeConfig)
    model: Any = field(default_factory=lambda: {"_target_": "mnist_dist.model.ConvNet"})
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    gpus: int = 1  # devices, i.e. worker processes in ddp modes
    device: str = "auto"  # auto | cuda | cpu; auto = cuda when available
    epochs: int = 14
    batch_size: int = 64  # GLOBAL batch per optimizer step, in every mode, so curves compare
    test_batch_size: int = 1000
    seed: int = 1
    log_every: int = 10  # steps between loss/throughput scalars
    warmup_steps: int = 5  # steps left out of throughput numbers (allocator, caches, first buckets)
    progress: bool = True  # tqdm bar on rank 0


class ConfigError(ValueError):
    """A setting that composes but cannot run; the message is one line with the numbers."""


def validate(cfg: Config) -> None:
    """Checks the composed config makes sense before any process starts or any file is written."""
    if cfg.mode.name not in ("single", *DISTRIBUTED_MODES):
        raise ConfigError(f"mode.name={cfg.mode.name!r} is not one of single, ddp, torch_ddp")
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device={cfg.device!r} is not one of auto, cuda, cpu")
    for key in ("gpus", "epochs", "batch_size", "test_batch_size", "log_every"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.mode.message_size <= 0:
        raise ConfigError(f"mode.message_size={cfg.mode.message_size} must be positive")
    ranks = world_size(cfg)
    if cfg.batch_size % ranks:
        raise ConfigError(
            f"batch_size={cfg.batch_size} (global) is not divisible by {ranks} ranks; "
            f"use a multiple of {ranks}, e.g. batch_size={cfg.batch_size // ranks * ranks or ranks}"
        )


def world_size(cfg: Config) -> int:
    """Number of worker processes: one per device in the distributed modes, else one."""
    return cfg.gpus if cfg.mode.name in DISTRIBUTED_MODES else 1


def data_root(cfg: Config) -> str:
    return os.path.expanduser(cfg.data.root)


ConfigStore.instance().store(name="schema", node=Config)
