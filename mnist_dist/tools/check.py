"""Pre-flight check: will this model train correctly in every mode? Seconds, with no data set.

    python -m mnist_dist.tools.check                                           # the convnet
    python -m mnist_dist.tools.check model=resnet
    python -m mnist_dist.tools.check model._target_=my_pkg.models.MyNet ~model.dropout

Arguments are Hydra overrides, as for ``python -m mnist_dist``: the model is built from the config, and
``mode.*`` options (sync_batchnorm, find_unused_parameters, dp_block, split_at) and ``deterministic``
count. It takes one step in every mode on random MNIST-shaped batches, ddp, torch_ddp and fsdp on 2 CPU
ranks with gloo, and prints one line per check: OK, WARN or FAIL, and why. Exits 1 if any check fails.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from mnist_dist.operations.errors import exit_on_interrupt, interrupted, raise_on_interrupt

if __name__ == "__main__":
    exit_on_interrupt()  # before the imports below (torch, Hydra: seconds): Ctrl-C meanwhile is one line too

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from mnist_dist.config import Config, ConfigError, describe_hydra_error, validate
from mnist_dist.model import instantiate_model
from mnist_dist.modes import MODES, Processes, wrap_model
from mnist_dist.operations import files
from mnist_dist.parallel import WorkerFailed, spawn, unwrap
from mnist_dist.parallel.state import model_state
from mnist_dist.step import Precision, compute_gradients, train_step
from mnist_dist.topology import deterministic_kernels, device_type, resolve

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
    why += "; ddp stops with an error naming them. Use them in forward, set requires_grad=False, or "
    return "FAIL", "unused parameters", why + "mode.find_unused_parameters=true"


def check_batchnorm(cfg: Config, model: nn.Module) -> Line:
    layers = [name for name, module in model.named_modules() if isinstance(module, BATCHNORM)]
    if not layers:
        return "OK", "batchnorm", "no BatchNorm layers"
    if getattr(cfg.mode, "sync_batchnorm", False):
        return "OK", "batchnorm", f"{len(layers)} BatchNorm layer(s) normalise over the global batch in ddp modes"
    why = (
        f"{len(layers)} BatchNorm layer(s) ({names(layers)}) normalise with each rank's share of the batch in ddp "
        f"modes ({cfg.batch_size // cfg.gpus} images at batch_size={cfg.batch_size}, gpus={cfg.gpus}), not the "
        "global batch: it rarely matters at 32 or more, it hurts below about 16; mode.sync_batchnorm=true uses the "
        "global batch's statistics (then ddp equals single)"
    )
    return "WARN", "batchnorm", why


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
        why = (
            "with deterministic=true the trainer warns and runs would differ: replace the op or set deterministic=false"
        )
        return "FAIL", "determinism", f"{str(error).splitlines()[0]} (on {device.type}); {why}"
    finally:
        deterministic_kernels(previous[0], warn_only=previous[1])
    return "OK", "determinism", f"one step with torch.use_deterministic_algorithms(True) on {device.type}"


# Our DDP and torch DDP divide by the world size and then sum the same two tensors, so they agree to
# rounding; a real difference (a gradient missed or averaged twice) is orders of magnitude larger.
TOLERANCE = 1e-5
# fsdp with mode.param_dtype or reduce_dtype bfloat16 computes with 8-bit mantissas: there the check is
# |fsdp - torch DDP| / |torch DDP| over all gradients: a bf16 copy is a few percent off fp32 on these
# random batches, while gradients missed or summed instead of averaged are 100 % off.
BF16_TOLERANCE = 0.25


def _rank_checks(rank: int, world_size: int, cfg: Config, find_unused: bool, out: str) -> None:
    """On each of the ranks: one step with our DDP and one with torch DDP, from the same weights and
    data; rank 0 writes what it found to ``out``."""
    torch.set_num_threads(1)  # the ranks share a small CPU
    dist.init_process_group("gloo")
    try:
        x, y = random_batch(1 + rank)  # each rank its own data, as in training
        wrapped, grads = {}, {}
        for name in ("ddp", "torch_ddp"):  # ours against the oracle
            mode = MODES[name].schema(name=name, find_unused_parameters=find_unused)
            if cfg.mode.name == name:  # as configured
                mode = dataclasses.replace(cfg.mode, find_unused_parameters=find_unused)
            wrapped[name] = wrap_model(build(cfg), mode, torch.device("cpu"))
            torch.manual_seed(cfg.seed + rank)  # the same dropout masks under both wrappers
            step(wrapped[name], x, y)
            grads[name] = torch.cat([_grad(p).flatten() for p in unwrap(wrapped[name]).parameters()])
        difference = (grads["ddp"] - grads["torch_ddp"]).abs().max()
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        sharded = _fsdp_step(cfg, rank, x, y, grads["torch_ddp"])
        # Buffers after one step: the wrappers broadcast rank 0's before each forward, which then
        # updates each rank's copy from its own batch.
        differing = []
        for name, buffer in unwrap(wrapped["ddp"]).named_buffers():
            reference = buffer.clone()
            dist.broadcast(reference, src=0)
            differs = torch.tensor(float(not torch.equal(buffer, reference)))
            dist.all_reduce(differs, op=dist.ReduceOp.MAX)
            if differs.item():
                differing.append(name)
        if rank == 0:
            buffers = len(list(unwrap(wrapped["ddp"]).buffers()))
            report = {"difference": difference.item(), "differing": differing, "buffers": buffers, **sharded}
            files.write_text(Path(out), json.dumps(report))
        dist.barrier()  # leave together: a peer that disconnects while rank 0 still works can abort it
    finally:
        dist.destroy_process_group()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def _fsdp_step(cfg: Config, rank: int, x: torch.Tensor, y: torch.Tensor, reference: torch.Tensor) -> dict:
    """One step in fsdp (as configured, or with conf/mode/fsdp.yaml's defaults): how far its gathered
    gradients are from torch DDP's, and whether its full state dict loads into a fresh model."""
    mode = cfg.mode if cfg.mode.name == "fsdp" else MODES["fsdp"].schema(name="fsdp")
    try:
        model = wrap_model(build(cfg), mode, torch.device("cpu"))
        torch.manual_seed(cfg.seed + rank)  # the dropout masks the DDP steps drew
        step(model, x, y)
    except Exception as error:  # the same model and settings on every rank: every rank fails alike
        return {"fsdp_error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    # full_tensor() gathers each gradient's shards: a collective, in the same order on every rank
    grads = [torch.zeros(p.shape) if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
    error = torch.cat([g.flatten() for g in grads]) - reference
    bf16 = "bfloat16" in (mode.param_dtype.name, mode.reduce_dtype.name)
    difference = error.norm() / reference.norm() if bf16 else error.abs().max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    state = model_state(model)  # a collective too
    loads = _load_error(build(cfg), state) if rank == 0 else ""
    return {
        "fsdp_difference": difference.item(),
        "fsdp_tolerance": BF16_TOLERANCE if bf16 else TOLERANCE,
        "fsdp_plain": loads,
    }


def _load_error(model: nn.Module, state: dict) -> str:
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        return " ".join(str(error).split())
    return ""


def check_distributed(cfg: Config, find_unused: bool) -> list[Line]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "rank_0.json")
        try:
            spawn(_rank_checks, RANKS, cfg, find_unused, str(out), start_method="forkserver")  # CPU ranks
        except WorkerFailed as error:
            return [("FAIL", "ddp", f"a step with our DDP or torch DDP failed: {error} (traceback above)")]
        report = json.loads(out.read_text())
    return [_agreement(report), _fsdp(report), _buffers(report)]


def _agreement(report: dict) -> Line:
    numbers = f"{report['difference']:.1e} (tolerance {TOLERANCE:g})"
    if report["difference"] <= TOLERANCE:
        return "OK", "ddp vs torch ddp", f"gradients agree within {numbers} on {RANKS} ranks"
    why = f"gradients differ by {numbers}: our DDP does not average this model's gradients as torch DDP does"
    return "FAIL", "ddp vs torch ddp", why


def _fsdp(report: dict) -> Line:
    if "fsdp_error" in report:
        return "FAIL", "fsdp", f"a step with mode=fsdp failed: {report['fsdp_error']}"
    if report["fsdp_plain"]:
        return "FAIL", "fsdp", f"its full state dict does not load into a fresh model: {report['fsdp_plain']}"
    numbers = f"{report['fsdp_difference']:.1e} (tolerance {report['fsdp_tolerance']:.1e})"
    if report["fsdp_difference"] > report["fsdp_tolerance"]:
        return "FAIL", "fsdp", f"gradients differ from torch DDP's by {numbers}"
    return (
        "OK",
        "fsdp",
        f"gradients agree with torch DDP's within {numbers} on {RANKS} ranks; its full state dict loads",
    )


def _buffers(report: dict) -> Line:
    if not report["differing"]:
        buffers = report["buffers"]
        return (
            "OK",
            "rank buffers",
            f"{buffers} buffer(s), equal on every rank after a step" if buffers else "no buffers",
        )
    why = (
        f"{len(report['differing'])} buffer(s) differ across ranks after a step ({names(report['differing'])}): "
        "each rank updates them from its own batch. Both DDPs give every rank rank 0's before each forward, and "
        "the trainer does before it evaluates: evaluation and checkpoints use rank 0's, so the buffers differ "
        "only between those moments"
    )
    return "WARN", "rank buffers", why


def run_checks(cfg: Config) -> list[Line]:
    modes, unused = check_modes(cfg)
    distributed = check_distributed(cfg, find_unused=bool(unused))
    return [modes, check_unused(cfg, unused), check_batchnorm(cfg, build(cfg)), check_determinism(cfg), *distributed]


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):  # Hydra would read it as an override
        print(__doc__)
        return 0
    try:
        with initialize_config_module("mnist_dist.conf", version_base="1.3"):
            cfg: Config = OmegaConf.to_object(compose("config", overrides=argv))
        validate(cfg, resolve(cfg))
        parameters = sum(p.numel() for p in build(cfg).parameters())
    except HydraException as error:
        sys.exit(f"error: {describe_hydra_error(error)}")
    except ConfigError as error:
        sys.exit(f"error: {error}")
    print(
        f"checking {cfg.model['_target_']} ({parameters:,} parameters): one step per mode on random "
        f"batches of {BATCH} images per rank, ddp, torch_ddp and fsdp on {RANKS} CPU ranks",
        flush=True,
    )
    lines = run_checks(cfg)
    width = max(len(check) for _, check, _ in lines)
    for status, check, why in lines:
        print(f"{status:<5} {check:<{width}}  {why}")
    counts = {status: sum(line[0] == status for line in lines) for status in ("FAIL", "WARN")}
    verdict = "fix the FAILs before training" if counts["FAIL"] else "ready to train"
    print(f"{counts['FAIL']} FAIL, {counts['WARN']} WARN: {verdict}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    raise_on_interrupt()  # Ctrl-C and SIGTERM: the check's ranks are stopped, then one line
    try:  # the module as imported, not __main__: the ranks find _rank_checks there
        from mnist_dist.tools import check

        sys.exit(check.main(sys.argv[1:]))
    except KeyboardInterrupt:
        interrupted("interrupted; the checks did not finish")
