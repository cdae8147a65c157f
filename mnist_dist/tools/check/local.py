"""The checks that need one process: a step in every one-process mode, unused parameters, BatchNorm,
determinism."""

from __future__ import annotations

from typing import Any

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from mnist_dist.config import Config, ConfigError
from mnist_dist.modes import MODES, Processes, wrap_model
from mnist_dist.step import Precision, train_step
from mnist_dist.tools.check.common import BATCH, RANKS, Line, build, names, random_batch, step
from mnist_dist.topology import deterministic_kernels, device_type

BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def one_process_modes(cfg: Config) -> dict[str, Any]:
    """Every one-process mode of the table with its conf/mode/ settings; the configured mode as configured."""
    names = [name for name, mode in MODES.items() if mode.processes is Processes.ONE]
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        modes = {name: OmegaConf.to_object(compose("config", overrides=[f"mode={name}"]).mode) for name in names}
    if cfg.mode.name in modes:
        modes[cfg.mode.name] = cfg.mode
    return modes


def check_modes(cfg: Config) -> tuple[Line, list[str]]:
    """One step in each single-process mode (their CPU equivalents); also returns the parameters that
    got no gradient in single mode."""
    variants = one_process_modes(cfg)
    x, y = random_batch(0, RANKS * BATCH)
    failed, unusable, unused = [], [], []
    for name, mode in variants.items():
        try:
            model = wrap_model(build(cfg), mode, torch.device("cpu"))
            step(model, x, y)
        except ConfigError as error:  # dp_block and split need a submodule of that name
            unusable.append(f"{name} ({error})")
            continue
        except Exception as error:
            failed.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        if name == "single":
            unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if failed:
        return ("FAIL", "modes", "; ".join(failed)), unused
    if unusable:
        return ("WARN", "modes", f"other modes took a step; not usable as configured: {'; '.join(unusable)}"), unused
    return ("OK", "modes", f"{', '.join(variants)} took a step (ddp, torch_ddp, fsdp below)"), unused


def check_unused(cfg: Config, unused: list[str]) -> Line:
    if not unused:
        return "OK", "unused parameters", "every parameter that requires grad got a gradient"
    why = f"{len(unused)} parameter(s) got no gradient: {names(unused)}"
    if getattr(cfg.mode, "find_unused_parameters", False):
        return "WARN", "unused parameters", f"{why}; allowed by mode.find_unused_parameters=true, they never train"
    return (
        "FAIL",
        "unused parameters",
        f"{why}; ddp stops with an error naming them. Use them in forward, "
        "set requires_grad=False, or mode.find_unused_parameters=true",
    )


def check_batchnorm(cfg: Config, model: nn.Module) -> Line:
    layers = [name for name, module in model.named_modules() if isinstance(module, BATCHNORM)]
    if not layers:
        return "OK", "batchnorm", "no BatchNorm layers"
    if getattr(cfg.mode, "sync_batchnorm", False):
        return "OK", "batchnorm", f"{len(layers)} BatchNorm layer(s) normalise over the global batch in ddp modes"
    share = cfg.batch_size // cfg.gpus
    return (
        "WARN",
        "batchnorm",
        f"{len(layers)} BatchNorm layer(s) ({names(layers)}) normalise with each "
        f"rank's share of the batch in ddp modes ({share} images at batch_size={cfg.batch_size}, "
        f"gpus={cfg.gpus}), not the global batch: it rarely matters at 32 or more, it hurts below "
        "about 16; mode.sync_batchnorm=true uses the global batch's statistics (then ddp equals single)",
    )


def check_determinism(cfg: Config) -> Line:
    """One optimizer step with deterministic kernels enforced: an op that has none raises, naming itself."""
    if not cfg.deterministic:
        return "SKIP", "determinism", "deterministic=false: runs need not repeat bit for bit"
    device = torch.device(device_type(cfg.device, 1))
    model = build(cfg).to(device)
    optimizer = instantiate(cfg.optim)(model.parameters())
    x, y = random_batch(0)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    deterministic_kernels(True, warn_only=False)  # the trainer warns; here such an op raises
    try:
        train_step(model, optimizer, x.to(device), y.to(device), Precision("off", device))
    except RuntimeError as error:
        return (
            "FAIL",
            "determinism",
            f"{str(error).splitlines()[0]} (on {device.type}); with deterministic="
            "true the trainer warns and runs would differ: replace the op or set deterministic=false",
        )
    finally:
        deterministic_kernels(previous[0], warn_only=previous[1])
    return "OK", "determinism", f"one step with torch.use_deterministic_algorithms(True) on {device.type}"
