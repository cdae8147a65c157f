"""The configuration schema: every setting, with its default and why it exists (each mode's knobs: modes.py), onto
which Hydra merges ``conf/``, so that a misspelt key or a value of the wrong type fails while the config is composed."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from torch import nn

from mnist_dist.modes import MODES, compile_refusal
from mnist_dist.operations.errors import ConfigError
from mnist_dist.topology import Topology, launcher

Amp = StrEnum("Amp", ["off", "bf16", "fp16"])  # autocast for forward and loss; fp16 adds a GradScaler
Device = StrEnum("Device", ["auto", "cuda", "cpu"])  # auto: cuda when available


@dataclass
class DataConfig:
    name: str = MISSING  # mnist | fashion_mnist (conf/data/)
    # holds <root>/MNIST/raw, <root>/FashionMNIST/raw (torchvision's layout): one copy for every run and clone
    root: str = "${oc.env:MNIST_DIST_DATA,'~/.cache/mnist_dist'}"
    mirrors: list[str] = field(default_factory=list)  # http(s) URLs or directories, tried in order
    mean: float = MISSING  # per-pixel normalisation of the training set
    std: float = MISSING


@dataclass
class DistConfig:
    timeout_s: int = 60  # a collective that waits longer than this fails instead of hanging


@dataclass
class Config:
    mode: Any = MISSING  # a structured config of mnist_dist/modes.py, chosen by conf/mode/<name>.yaml
    model: Any = MISSING  # _target_: the model class, and its constructor arguments (conf/model/)
    data: DataConfig = field(default_factory=DataConfig)
    # _target_: a torch.optim class with _partial_: true; any constructor argument can be set (conf/optim/)
    optim: Any = MISSING
    scheduler: Any = MISSING  # _target_: a torch.optim.lr_scheduler class, stepped after every epoch
    dist: DistConfig = field(default_factory=DistConfig)
    gpus: int = 1  # devices, i.e. worker processes in ddp modes
    device: Device = Device.auto
    epochs: int = 14
    batch_size: int = 64  # GLOBAL batch per optimizer step, in every mode, so curves compare
    # Micro-batches per optimizer step, each rank's share of batch_size split into this many; ddp modes all-reduce
    # after the last only (no_sync before), so memory per pass drops by this factor.
    accumulate: int = 1
    test_batch_size: int = 1000
    seed: int = 1
    log_every: int = 10  # steps between loss/throughput scalars
    warmup_steps: int = 5  # steps left out of throughput numbers (allocator, caches, first buckets)
    progress: bool = True  # tqdm bar on rank 0
    amp: Amp = Amp.off
    channels_last: bool = False  # NHWC memory layout for images and convolution weights
    compile: bool = False  # torch.compile the model (in place) before the mode wraps it
    # The same numbers every run; on GPU no cuDNN autotuning nor atomics-based kernels (a few percent here).
    deterministic: bool = True
    # fp32 convolutions and matmuls on CUDA in TF32 (faster on Ampere and later). Off: torch 2.14 would run cuDNN
    # convolutions in TF32 unasked, and results would differ from the CPU's by far more than fp32 rounding.
    tf32: bool = False
    target_accuracy: float = 0.0  # stop once the exact test accuracy (a fraction) reaches this; 0: every epoch
    eval_every_steps: int = 0  # also evaluate every this many optimizer steps; 0: at epoch ends only
    label_smoothing: float = 0.0  # of the training loss (the test loss stays plain cross-entropy)
    recipe: str = "classic"  # set by conf/recipe/<name>.yaml: which recipe chose the settings above
    # a checkpoint.pt, or a run directory holding one: continue that run, there. auto: this run directory's
    # checkpoint if it has one, else start fresh (torchrun restarts, SLURM requeues)
    resume: str = ""
    checkpoint_every_steps: int = 0  # also checkpoint mid-epoch every this many steps; 0: at epoch ends only
    profile: bool = False  # torch.profiler over 5 steps after warm-up: trace_rank<r>.json in the run directory


_RANGES = {  # inclusive
    **dict.fromkeys(("gpus", "epochs", "test_batch_size", "log_every", "accumulate"), (1, math.inf)),
    "batch_size": (1, 60_000),  # the training set, MNIST's as Fashion-MNIST's: a larger batch would run no step
    **dict.fromkeys(("eval_every_steps", "checkpoint_every_steps"), (0, math.inf)),
    # numpy's seeds; each epoch's order is seeded with seed * 100003 + epoch, within torch's 64 bits
    "seed": (0, 2**32 - 1),
    "dist.timeout_s": (1, 7 * 24 * 3600),  # torch keeps it in milliseconds, timedelta in days
    "target_accuracy": (0, 1),  # a fraction, as in results.json
    "label_smoothing": (0, 1),
}


def validate(cfg: Config, topology: Topology) -> None:
    """Every check a setting gets once the job's topology is known, before any worker starts. Checked elsewhere: the
    devices (topology), the data's size (data), a resume (checkpoint)."""
    _each_setting(cfg)  # first: the checks below compute with them
    _check_model(cfg.model)
    by, mode, size = launcher(), MODES[cfg.mode.name], topology.world_size
    if by and cfg.gpus not in (1, size):  # 1, the default: the launcher says how many
        raise ConfigError(f"gpus={cfg.gpus}, but {by} started {size} processes, which is what runs; leave gpus= out")
    if by and not mode.per_device:
        raise ConfigError(f"{by} started {size} processes, mode={mode.name} runs one; use mode=ddp, torch_ddp or fsdp")
    if (most := mode.max_gpus) and cfg.gpus > most:
        raise ConfigError(f"gpus={cfg.gpus}: mode={mode.name} uses at most {most} devices; use gpus={most}")
    if refusal := compile_refusal(cfg, topology.device_type):
        raise ConfigError(refusal)
    parts = size * cfg.accumulate  # the global batch splits into equal shares per rank and micro-batch
    if cfg.batch_size % parts:
        micro = f" x accumulate={cfg.accumulate}" if cfg.accumulate > 1 else ""
        raise ConfigError(
            f"batch_size={cfg.batch_size} (global) is not divisible by {size} ranks{micro}; use a multiple of "
            f"{parts}, e.g. batch_size={cfg.batch_size // parts * parts or parts}"
        )


def _each_setting(cfg: Config) -> None:  # on its own: a number in its range (nan is in none)
    for key, (least, most) in _RANGES.items():
        if not least <= (value := attrgetter(key)(cfg)) <= most:
            bound = f"at least {least}" if most == math.inf else f"from {least} to {most}"
            raise ConfigError(f"{key}={value} must be {bound}")
    lr = cfg.optim.get("lr", 1.0)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"optim.lr={lr} must be a finite positive number")
    bucket_cap_mb = getattr(cfg.mode, "bucket_cap_mb", None)
    if bucket_cap_mb is not None and not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
        raise ConfigError(f"mode.bucket_cap_mb={bucket_cap_mb} must be positive (MiB), or null: torch's default")


def _check_model(model: dict) -> None:
    """A misspelt model argument or a target that is no Module: one line in the parent, not a traceback per rank."""
    target = str(model.get("_target_"))
    module, _, name = target.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"model._target_={target} cannot be imported ({error}); check the name, and make its module importable: "
            "usually PYTHONPATH=<the directory that holds the package> python -m mnist_dist ..."
        ) from None
    if not callable(factory) or (isinstance(factory, type) and not issubclass(factory, nn.Module)):
        raise ConfigError(
            f"model._target_={target} is not a torch.nn.Module class; name one, e.g. mnist_dist.model.ConvNet"
        )
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in model:
        if not str(key).startswith("_") and key not in parameters:
            raise ConfigError(
                f"model._target_={target} takes no argument {key!r}, which the model config passes; add "
                f"~model.{key} to the command line to leave it out"
            )


def refuse_unknown_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuses a ``+key=`` where the schema has none, which to_object would drop (model, optim, scheduler take any)."""
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in cfg:
        if key not in fields:
            raise ConfigError(
                f"+{prefix}{key}: {schema.__name__} has no setting {key!r}, so it would be ignored; valid keys: "
                f"{', '.join(fields)}"
            )
        if isinstance(child := cfg._get_node(key), DictConfig):
            refuse_unknown_keys(child, f"{prefix}{key}.")


def describe_hydra_error(error: Exception) -> str:
    """A Hydra composition error in one line: its and its cause's first lines, the schema's keys, a group's options."""
    if isinstance(error, MissingConfigException) and error.options is not None:  # mode=foo
        group, choice = os.path.split(error.missing_cfg_file)
        return f"{group}={choice} is not an option; choose one of {', '.join(error.options)}"
    message, cause = str(error).splitlines()[0].rstrip("."), error.__cause__
    if isinstance(cause, OmegaConfBaseException):
        message += f": {cause.msg.splitlines()[0]}"
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(cause.object_type):
        message += f"; valid keys: {', '.join(f.name for f in dataclasses.fields(cause.object_type))}"
    return message


ConfigStore.instance().store(name="schema", node=Config)
