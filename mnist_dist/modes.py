"""The mode table: each mode's wrap function, structured config (its knobs: another mode's is an error while
the config is composed) and process layout, read by validation, launch, the worker and the tools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.operations.errors import ConfigError
from mnist_dist.parallel import DistributedDataParallel, data_parallel, split
from mnist_dist.parallel.fsdp import shard
from mnist_dist.parallel.syncbn import convert_sync_batchnorm


@dataclass
class SingleMode:
    name: str = "single"


@dataclass
class DataParallelMode:
    name: str = "dp"
    dp_block: str = ""  # wrap only this submodule (e.g. features) in DataParallel; "" = the whole model


@dataclass
class SplitMode:
    name: str = "split"
    split_at: str = "classifier"  # this submodule and those after it run on the second device


@dataclass
class DDPMode:
    """ddp and torch_ddp: one process per device, each with the whole model, gradients averaged."""

    name: str = "ddp"
    find_unused_parameters: bool = False  # allow parameters that get no gradient
    # BatchNorm over the global batch instead of each rank's share (a collective per layer in forward and in
    # backward): then ddp computes what single does. On CUDA torch's SyncBatchNorm, elsewhere ours (syncbn.py).
    sync_batchnorm: bool = False
    # MiB per all-reduce bucket (torch's bucket_cap_mb), in both DDPs, which cut buckets alike. null: torch's
    # default, 25 with the first bucket capped at 1 so that it starts early; a number caps every bucket.
    bucket_cap_mb: float | None = None
    # .grad is a view of its all-reduce bucket: one copy per gradient and step fewer, one gradient's memory less
    gradient_as_bucket_view: bool = False


@dataclass
class FSDPMode:
    name: str = "fsdp"
    # Free each layer group's gathered parameters after its forward (true: least memory; backward
    # gathers them again) or keep them until backward (false: one all-gather fewer per group and step).
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Mode:
    name: str  # the choice: mode=<name>, conf/mode/<name>.yaml, results.json's "mode"
    schema: type  # its structured config: the knobs it has, with their defaults
    wrap: Callable[[nn.Module, Any, torch.device, int], nn.Module]  # (model, mode config, device, gpus)
    per_device: bool = False  # one worker process per device (`gpus` of them); else one, the launching process
    all_gpus: bool = False  # the one process drives `gpus` devices (dp, split); else one device each
    max_gpus: int | None = None  # the most devices the mode can use

    def devices(self, gpus: int) -> int:
        """CUDA devices the job drives for ``gpus``: one per process, or all of them for an all-GPU mode."""
        return min(gpus, self.max_gpus or gpus) if self.all_gpus or self.per_device else 1


def world_size(cfg: Any) -> int:
    return cfg.gpus if MODES[cfg.mode.name].per_device else 1


def compile_refusal(cfg: Any, device_type: str) -> str:
    """Why compile=true cannot run in ``cfg`` on ``device_type``, naming the fix, or "": the one home of the rule."""
    schema, devices = MODES[cfg.mode.name].schema, MODES[cfg.mode.name].devices(cfg.gpus)
    if cfg.compile and schema is DataParallelMode and device_type == "cuda" and devices > 1:
        # model.compile() binds the compiled call to the module itself, and DataParallel's replicate() copies
        # each module's __dict__, that binding included: every replica would run cuda:0's weights.
        return (
            f"compile=true with mode={cfg.mode.name} on {devices} GPUs: DataParallel's replicas would all run "
            "cuda:0's compiled model; use mode=torch_ddp (one process per GPU), gpus=1, or compile=false"
        )
    return ""


def wrap_model(model: nn.Module, mode: Any, device: torch.device, gpus: int = 1) -> nn.Module:
    """``model`` on ``device`` (this process's), wrapped as ``mode`` (a mode config) says; dp and split use
    ``gpus`` devices; a mode's process group must exist."""
    return MODES[mode.name].wrap(model, mode, device, gpus)


def _data_parallel(model: nn.Module, mode: DataParallelMode, device: torch.device, gpus: int) -> nn.Module:
    device_ids = list(range(gpus)) if device.type == "cuda" else []  # []: a pass-through on CPU
    functional = mode.name == "dp_functional"  # replicate, scatter, parallel_apply and gather by hand
    return _no_such_submodule(data_parallel, model.to(device), device_ids, mode.dp_block, functional)


def _split(model: nn.Module, mode: SplitMode, device: torch.device, gpus: int) -> nn.Module:
    # Two GPUs: one part on each. One GPU: the tutorial's CPU + GPU example. No GPU: both on the CPU.
    first, second = ("cuda:0", "cuda:1") if device.type == "cuda" and gpus > 1 else ("cpu", device)
    return _no_such_submodule(split, model, mode.split_at, torch.device(first), torch.device(second))


def _no_such_submodule(wrap: Callable[..., nn.Module], *args) -> nn.Module:
    try:
        return wrap(*args)
    except ValueError as error:  # the model has no submodule of the name the mode config gives
        raise ConfigError(error.args[0]) from None


def _sync_batchnorm(model: nn.Module, mode: DDPMode, device: torch.device) -> nn.Module:
    model = model.to(device)
    if not mode.sync_batchnorm:
        return model
    # Before wrapping, so that the wrapper registers the converted layers (same parameters). torch's
    # raises on CPU tensors, and its fused CUDA kernels are faster than ours.
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if device.type == "cuda" else convert_sync_batchnorm(model)


def _ddp(model: nn.Module, mode: DDPMode, device: torch.device, gpus: int) -> nn.Module:
    """Ours or torch's, with the same arguments."""
    return (DistributedDataParallel if mode.name == "ddp" else TorchDDP)(
        _sync_batchnorm(model, mode, device),
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=mode.find_unused_parameters,
        bucket_cap_mb=mode.bucket_cap_mb,
        gradient_as_bucket_view=mode.gradient_as_bucket_view,
    )


def _fsdp(model: nn.Module, mode: FSDPMode, device: torch.device, gpus: int) -> nn.Module:
    return shard(model, device, mode.reshard_after_forward)


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("single", SingleMode, lambda model, mode, device, gpus: model.to(device)),
        Mode("dp", DataParallelMode, _data_parallel, all_gpus=True),
        Mode("dp_block", DataParallelMode, _data_parallel, all_gpus=True),
        Mode("dp_functional", DataParallelMode, _data_parallel, all_gpus=True),
        Mode("split", SplitMode, _split, all_gpus=True, max_gpus=2),
        Mode("ddp", DDPMode, _ddp, per_device=True),
        Mode("torch_ddp", DDPMode, _ddp, per_device=True),
        Mode("fsdp", FSDPMode, _fsdp, per_device=True),
    )
}
for _mode in MODES.values():  # each structured config, as Hydra's mode_schema/<name> (conf/mode/<name>.yaml)
    ConfigStore.instance().store(group="mode_schema", name=_mode.name, node=_mode.schema(name=_mode.name))
