"""Pre-flight check: will this model train correctly in every mode? No data set needed.

    python -m mnist_dist.tools.check                                           # the convnet
    python -m mnist_dist.tools.check model=fastnet
    python -m mnist_dist.tools.check model._target_=my_pkg.models.MyNet ~model.dropout

Arguments are Hydra overrides, as for ``python -m mnist_dist`` (``mode.*`` options and ``deterministic`` count).
It takes one step in every mode on random MNIST-shaped batches, ddp, torch_ddp and fsdp on 2 CPU ranks, and
prints one line per check: OK, WARN or FAIL, and why. Exits 1 if any check fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from mnist_dist.operations.errors import NOTHING_STARTED, interrupted, on_interrupt

if __name__ == "__main__":
    on_interrupt(NOTHING_STARTED)  # before the slow imports below (torch, Hydra): Ctrl-C meanwhile is one line too

import torch
import torch.distributed as dist
from hydra.errors import HydraException
from hydra.utils import instantiate
from torch import nn

from mnist_dist.config import Config, ConfigError, describe_hydra_error, validate
from mnist_dist.model import instantiate_model
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.operations import files
from mnist_dist.parallel import WorkerFailed, spawn, unwrap
from mnist_dist.parallel.state import model_state
from mnist_dist.step import Precision, compute_gradients, train_step
from mnist_dist.tools import composed
from mnist_dist.topology import deterministic_kernels, device_type, resolve

RANKS = 2
BATCH = 8  # images per rank and step: enough for BatchNorm statistics

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


def names(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def check_modes(cfg: Config) -> tuple[Line, list[str]]:
    """One step in each one-process mode (their CPU equivalents) with its conf/mode/ settings, the configured
    mode as configured; also returns the parameters that got no gradient in single mode."""
    variants = {
        name: cfg.mode if name == cfg.mode.name else composed(f"mode={name}").mode
        for name, mode in MODES.items()
        if not mode.per_device
    }
    x, y = random_batch(0, RANKS * BATCH)
    failed, unusable, unused = [], [], []
    for name, mode in variants.items():
        try:
            step(model := wrap_model(build(cfg), mode, torch.device("cpu")), x, y)
        except ConfigError as error:  # dp_block and split need a submodule of that name
            unusable.append(f"{name} ({error})")
        except Exception as error:
            failed.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}")
        else:
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
    batchnorms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    layers = [name for name, module in model.named_modules() if isinstance(module, batchnorms)]
    if not layers:
        return "OK", "batchnorm", "no BatchNorm layers"
    if getattr(cfg.mode, "sync_batchnorm", False):
        return "OK", "batchnorm", f"{len(layers)} BatchNorm layer(s) normalise over the global batch in ddp modes"
    why = (
        f"{len(layers)} BatchNorm layer(s) ({names(layers)}) normalise with each rank's share of the batch in ddp "
        f"modes ({cfg.batch_size // cfg.gpus} images at batch_size={cfg.batch_size}, gpus={cfg.gpus}): it hurts "
        "below about 16; mode.sync_batchnorm=true uses the global batch's statistics"
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
        why = "the trainer only warns, and runs would differ: replace the op or set deterministic=false"
        return "FAIL", "determinism", f"{str(error).splitlines()[0]} (on {device.type}); {why}"
    finally:
        deterministic_kernels(previous[0], warn_only=previous[1])
    return "OK", "determinism", f"one step with torch.use_deterministic_algorithms(True) on {device.type}"


# Relative (|found - torch DDP| / |torch DDP| over all gradients): our DDP and fsdp (in fp32) sum the same
# tensors in another order, so they agree to rounding; a gradient missed, or summed instead of averaged, is 50 % off.
TOLERANCE = 1e-5


def _rank_checks(rank: int, world_size: int, cfg: Config, find_unused: bool, out: str) -> None:
    """On each rank: one step with our DDP, torch DDP and fsdp from the same weights and data (each rank its own
    batch, the same dropout masks under each wrapper); rank 0 writes what it found to ``out``."""
    torch.set_num_threads(1)  # the ranks share a small CPU
    dist.init_process_group("gloo", init_method=os.environ["MNIST_DIST_INIT_METHOD"], rank=rank, world_size=world_size)
    try:
        x, y = random_batch(1 + rank)
        grads, models = {}, {}
        for name in ("ddp", "torch_ddp", "fsdp"):  # torch DDP is the oracle; the DDPs as configured, fsdp in fp32
            mode = cfg.mode if cfg.mode.name == name != "fsdp" else MODES[name].schema(name=name)
            if name != "fsdp":
                mode = dataclasses.replace(mode, find_unused_parameters=find_unused)
            try:
                models[name] = wrap_model(build(cfg), mode, torch.device("cpu"))
                torch.manual_seed(cfg.seed + rank)
                step(models[name], x, y)
            except Exception as error:  # the same model and settings on every rank: every rank fails alike
                grads[name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
                continue
            # full_tensor() gathers fsdp's shards: a collective, in the same order on every rank
            grads[name] = torch.cat([_full_grad(p).flatten() for p in models[name].parameters()])
        report = {"errors": {name: grad for name, grad in grads.items() if isinstance(grad, str)}}
        if not report["errors"]:
            reference = grads["torch_ddp"]
            for name in ("ddp", "fsdp"):
                difference = (grads[name] - reference).norm() / reference.norm()
                dist.all_reduce(difference, op=dist.ReduceOp.MAX)
                report[name] = difference.item()
            state = model_state(models["fsdp"])  # a collective too
            if rank == 0:
                try:
                    build(cfg).load_state_dict(state)
                except RuntimeError as error:
                    report["fsdp_plain"] = "does not load into the model: " + " ".join(str(error).split())
            report["differing"] = _differing_buffers(unwrap(models["ddp"]))
            report["buffers"] = len(list(unwrap(models["ddp"]).buffers()))
        if rank == 0:
            files.write_text(Path(out), json.dumps(report))
        dist.barrier()  # leave together: a peer that disconnects while rank 0 still works can abort it
    finally:
        dist.destroy_process_group()


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s whole gradient (zeros if it got none); fsdp's shards gathered (a collective, every rank alike)."""
    return torch.zeros(p.shape) if p.grad is None else getattr(p.grad, "full_tensor", p.grad.detach)()


def _differing_buffers(model: nn.Module) -> list[str]:
    """The buffers that differ from rank 0's after a step: each rank updates them from its own batch."""
    differing = []
    for name, buffer in model.named_buffers():
        reference = buffer.clone()
        dist.broadcast(reference, src=0)
        differs = torch.tensor(float(not torch.equal(buffer, reference)))
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        differing += [name] if differs.item() else []
    return differing


def check_distributed(cfg: Config, find_unused: bool) -> list[Line]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "rank_0.json")
        try:
            spawn(_rank_checks, RANKS, cfg, find_unused, str(out), start_method="forkserver")  # CPU ranks
        except WorkerFailed as error:
            return [("FAIL", "ddp", f"a step on {RANKS} ranks failed: {error} (traceback above)")]
        report = json.loads(out.read_text())
    if report["errors"]:
        return [("FAIL", name, f"a step failed: {error}") for name, error in report["errors"].items()]
    lines = []
    for name in ("ddp", "fsdp"):
        ok, numbers = report[name] <= TOLERANCE, f"{report[name]:.1e} (relative, tolerance {TOLERANCE:g})"
        why = f"gradients {'agree with' if ok else 'differ from'} torch DDP's: {numbers} on {RANKS} ranks"
        lines.append(("OK" if ok else "FAIL", f"{name} vs torch ddp", why))
    error = report.get("fsdp_plain")
    lines.append(("FAIL" if error else "OK", "fsdp state", f"its full state dict (model.pt) {error or 'loads'}"))
    if report["differing"]:
        why = (
            f"{len(report['differing'])} buffer(s) differ across ranks after a step ({names(report['differing'])}): "
            "each rank updates them from its own batch; evaluation and checkpoints use rank 0's"
        )
        return [*lines, ("WARN", "rank buffers", why)]
    return [*lines, ("OK", "rank buffers", f"{report['buffers']} buffer(s), equal on every rank after a step")]


def run_checks(cfg: Config) -> list[Line]:
    modes, unused = check_modes(cfg)
    distributed = check_distributed(cfg, find_unused=bool(unused))
    return [modes, check_unused(cfg, unused), check_batchnorm(cfg, build(cfg)), check_determinism(cfg), *distributed]


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):  # Hydra would read it as an override
        print(__doc__)
        return 0
    try:
        cfg: Config = composed(*argv)
        validate(cfg, resolve(cfg))
        parameters = sum(p.numel() for p in build(cfg).parameters())
    except (HydraException, ConfigError) as error:
        sys.exit(f"error: {describe_hydra_error(error) if isinstance(error, HydraException) else error}")
    print(f"checking {cfg.model['_target_']} ({parameters:,} parameters): one step per mode", flush=True)
    lines = run_checks(cfg)
    width = max(len(check) for _, check, _ in lines)
    for status, check, why in lines:
        print(f"{status:<5} {check:<{width}}  {why}")
    fails, warns = (sum(line[0] == status for line in lines) for status in ("FAIL", "WARN"))
    print(f"{fails} FAIL, {warns} WARN: {'fix the FAILs before training' if fails else 'ready to train'}")
    return 1 if fails else 0


if __name__ == "__main__":
    on_interrupt()  # Ctrl-C and SIGTERM: the check's ranks are stopped, then one line
    try:  # the module as imported, not __main__: the ranks find _rank_checks there
        from mnist_dist.tools import check

        sys.exit(check.main(sys.argv[1:]))
    except KeyboardInterrupt:
        interrupted("interrupted; the checks did not finish")
