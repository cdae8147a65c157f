"""The checks on 2 CPU ranks (gloo): our DDP against torch DDP, fsdp, buffers across ranks, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mnist_dist.config import Config
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.operations import files
from mnist_dist.parallel import WorkerFailed, plain_state_dict, spawn, unwrap
from mnist_dist.parallel.state import model_state
from mnist_dist.tools.check.common import RANKS, Line, build, names, random_batch, step

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
            grads[name] = torch.cat(
                [
                    torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                    for p in unwrap(wrapped[name]).parameters()
                ]
            )
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
            report = {
                "difference": difference.item(),
                "differing": differing,
                "buffers": len(list(unwrap(wrapped["ddp"]).buffers())),
                **sharded,
            }
            for name, model in wrapped.items():
                report[f"{name}_plain"] = _load_error(build(cfg), plain_state_dict(model))
                report[f"{name}_naive"] = _load_error(build(cfg), model.state_dict())
            files.write_text(Path(out), json.dumps(report))
        dist.barrier()  # leave together: a peer that disconnects while rank 0 still works can abort it
    finally:
        dist.destroy_process_group()


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
    state = model_state(model)
    tolerance = BF16_TOLERANCE if bf16 else TOLERANCE
    return {
        "fsdp_difference": difference.item(),
        "fsdp_tolerance": tolerance,
        "fsdp_plain": _load_error(build(cfg), state) if rank == 0 else "",
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
    return [_agreement(report), _fsdp(report), _buffers(report), _checkpoint(report)]


def _agreement(report: dict) -> Line:
    if report["difference"] <= TOLERANCE:
        why = f"gradients agree within {report['difference']:.1e} (tolerance {TOLERANCE:g}) on {RANKS} ranks"
        return "OK", "ddp vs torch ddp", why
    return (
        "FAIL",
        "ddp vs torch ddp",
        f"gradients differ by {report['difference']:.1e} (tolerance {TOLERANCE:g}): our DDP does not "
        "average this model's gradients as torch DDP does",
    )


def _fsdp(report: dict) -> Line:
    if "fsdp_error" in report:
        return "FAIL", "fsdp", f"a step with mode=fsdp failed: {report['fsdp_error']}"
    if report["fsdp_plain"]:
        return "FAIL", "fsdp", f"its full state dict does not load into a fresh model: {report['fsdp_plain']}"
    numbers = f"{report['fsdp_difference']:.1e} (tolerance {report['fsdp_tolerance']:.1e})"
    if report["fsdp_difference"] > report["fsdp_tolerance"]:
        return "FAIL", "fsdp", f"gradients differ from torch DDP's by {numbers}"
    why = f"gradients agree with torch DDP's within {numbers} on {RANKS} ranks"
    return "OK", "fsdp", f"{why}; its full state dict loads into a fresh model"


def _buffers(report: dict) -> Line:
    if not report["differing"]:
        buffers = report["buffers"]
        return (
            "OK",
            "rank buffers",
            f"{buffers} buffer(s), equal on every rank after a step" if buffers else "no buffers",
        )
    return (
        "WARN",
        "rank buffers",
        f"{len(report['differing'])} buffer(s) differ across ranks after "
        f"a step ({names(report['differing'])}): each rank updates them from its own batch. "
        "Both DDPs give every rank rank 0's before each forward, and the trainer does before it evaluates: "
        "evaluation and checkpoints use rank 0's, so the buffers differ only between those moments",
    )


def _checkpoint(report: dict) -> Line:
    failures = {name: report[f"{name}_plain"] for name in ("ddp", "torch_ddp") if report[f"{name}_plain"]}
    if failures:
        return (
            "FAIL",
            "checkpoint",
            "plain_state_dict of the wrapped model does not load into a fresh "
            f"model: {'; '.join(f'{k}: {v}' for k, v in failures.items())}",
        )
    naive = "would not: its keys start with 'module.'" if report["ddp_naive"] else "would too"
    return (
        "OK",
        "checkpoint",
        "plain_state_dict(wrapped), which the trainer saves, loads into a "
        f"fresh model with no 'module.' prefix to strip; wrapped.state_dict() {naive}",
    )
