"""The configuration schema: every setting, declared once, with its default and why it exists.

Hydra merges the YAML files in ``conf/`` onto these dataclasses, so a misspelt key or a value of the
wrong type fails while the config is composed, before anything runs or is written.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf.errors import OmegaConfBaseException

# Where datasets live unless data.root says otherwise; outside the run directory so that every run,
# and every clone, shares one copy.
DEFAULT_DATA_ROOT = "${oc.env:MNIST_DIST_DATA,'~/.cache/mnist_dist'}"

DISTRIBUTED_MODES = ("ddp", "torch_ddp")  # one process per device
MODES = ("single", "dp", "split", *DISTRIBUTED_MODES)


@dataclass
class ModeConfig:
    name: str = "single"  # single | dp | split | ddp | torch_ddp: how the model is spread over devices
    dp_block: str = ""  # dp: wrap only this submodule (e.g. features) in DataParallel; "" = the whole model
    dp_functional: bool = False  # dp: replicate/scatter/parallel_apply/gather by hand, not nn.DataParallel
    split_at: str = "classifier"  # split: this submodule and those after it run on the second device
    # ddp only. Elements per all-reduce bucket (1M = 4 MB of fp32). Smaller buckets start communicating
    # earlier in backward, larger ones send fewer messages. apex used 10M, which puts this convnet's
    # 1.2M parameters in one bucket and so overlaps nothing; 1M sends fc1 (98 % of them) while the
    # convolutions' backward still runs.
    message_size: int = 1_000_000
    overlap: bool = True  # ddp: all-reduce while backward runs (false: only after it, for comparison)
    find_unused_parameters: bool = False  # ddp/torch_ddp: allow parameters that get no gradient
    compress_bf16: bool = False  # ddp: gradients travel as bf16 (half the bytes), summed in fp32
    # ddp/torch_ddp: BatchNorm layers become SyncBatchNorm, which normalises with the statistics of the
    # global batch instead of each rank's share, at the cost of a collective per layer in forward and
    # in backward. It matters when that share is small (below about 16 images; rarely at 32 or more),
    # and batch_size is global, so more ranks mean smaller shares. CUDA only: torch's SyncBatchNorm does
    # not run on CPU tensors.
    sync_batchnorm: bool = False


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
    amp: str = "off"  # off | bf16 | fp16: autocast for forward and loss (fp16 adds a GradScaler)
    channels_last: bool = False  # NHWC memory layout for images and convolution weights
    compile: bool = False  # torch.compile the model (in place) before the mode wraps it
    # Deterministic kernels and cuDNN settings: the same numbers every run. Free on CPU; on GPU it
    # rules out cuDNN autotuning and some atomics-based kernels (a few percent for this convnet).
    deterministic: bool = True
    resume: str = ""  # a checkpoint.pt, or a run directory holding one: continue that run, there
    resume_allow_changes: bool = False  # resume even if the model, global batch or world size changed


class ConfigError(ValueError):
    """A setting that composes but cannot run; the message is one line with the numbers."""


def validate(cfg: Config) -> None:
    """Checks the composed config makes sense before any process starts or any file is written."""
    if cfg.mode.name not in MODES:
        raise ConfigError(f"mode.name={cfg.mode.name!r} is not one of {', '.join(MODES)}")
    if cfg.amp not in ("off", "bf16", "fp16"):
        raise ConfigError(f"amp={cfg.amp!r} is not one of off, bf16, fp16")
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device={cfg.device!r} is not one of auto, cuda, cpu")
    for key in ("gpus", "epochs", "batch_size", "test_batch_size", "log_every"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    if not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be a finite number")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.dist.timeout_s <= 0:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s} must be at least 1 (seconds)")
    if cfg.mode.message_size <= 0:
        raise ConfigError(f"mode.message_size={cfg.mode.message_size} must be positive")
    if cfg.mode.name == "split" and cfg.gpus > 2:
        raise ConfigError(f"gpus={cfg.gpus}: mode=split puts the model on 2 devices; use gpus=2 (or 1: CPU + GPU)")
    ranks = world_size(cfg)
    if cfg.batch_size % ranks:
        raise ConfigError(
            f"batch_size={cfg.batch_size} (global) is not divisible by {ranks} ranks; "
            f"use a multiple of {ranks}, e.g. batch_size={cfg.batch_size // ranks * ranks or ranks}"
        )


def devices_needed(cfg: Config) -> int:
    """CUDA devices the mode drives: every process one in ddp modes, one process all of them in dp."""
    return 1 if cfg.mode.name == "single" else cfg.gpus


def world_size(cfg: Config) -> int:
    """Number of worker processes: one per device in the distributed modes, else one."""
    return cfg.gpus if cfg.mode.name in DISTRIBUTED_MODES else 1


def data_root(cfg: Config) -> str:
    return os.path.expanduser(cfg.data.root)


def describe_hydra_error(error: Exception) -> str:
    """Hydra's composition errors span several lines; say the same in one, with the valid choices."""
    text = str(error).split("Config search path")[0]
    # Hydra's hint "To append to your config use +key=..." does not apply: the schema is closed.
    lines = [line.strip() for line in text.splitlines() if line.strip() and "To append" not in line]
    message = lines[0].rstrip(".")
    if len(lines) > 1:  # "Available options in 'mode':" then one option per line
        message += f"; {lines[1]} {', '.join(lines[2:])}"
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException):
        message += f": {str(cause).splitlines()[0]}"
        schema = getattr(cause, "object_type", None)
        if dataclasses.is_dataclass(schema) and "not in" in str(cause):
            message += f"; valid keys: {', '.join(f.name for f in dataclasses.fields(schema))}"
    return message


ConfigStore.instance().store(name="schema", node=Config)
