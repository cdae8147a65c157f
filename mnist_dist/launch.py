"""The parent: choose the device, prepare the data once, then run the workers and watch them.

Three ways in, one worker (``mnist_dist.train.train``):

- single mode: the worker runs in this process;
- ddp modes: one spawned process per device, rendezvous on 127.0.0.1 at a free port;
- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set): this process *is* a worker; local rank 0 prepares
  the data while the others wait at a barrier. This is how the app runs across nodes.

A worker that fails stops the whole job: the others are terminated (no rank is left hanging in a
collective, pytorch/pytorch#17113), and the parent exits non-zero naming the rank and its error. The
spawning and supervising is ``mnist_dist.parallel.spawn``, which your own scripts can use as well.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mnist_dist import checkpoint, guards, rundir
from mnist_dist.config import DISTRIBUTED_MODES, Config, ConfigError, data_root, devices_needed, world_size
from mnist_dist.data import prepare, raw_dir
from mnist_dist.parallel import WorkerFailed, spawn
from mnist_dist.parallel.spawn import die_with_parent
from mnist_dist.train import train

__all__ = ["launch", "resolve_device", "WorkerFailed"]

log = logging.getLogger("mnist_dist")


def resolve_device(cfg: Config) -> str:
    """'cuda' or 'cpu' for ``cfg.device``, or a ConfigError that says what to change."""
    visible = torch.cuda.device_count()
    needed = devices_needed(cfg)
    if cfg.device == "cpu" or (cfg.device == "auto" and visible == 0):
        return "cpu"
    if visible < needed:
        raise ConfigError(
            f"device={cfg.device} needs {needed} CUDA device(s) for gpus={cfg.gpus} but "
            f"{visible} are visible; use gpus={visible} or device=cpu"
            if visible
            else f"device={cfg.device} but no CUDA device is visible; use device=cpu or device=auto"
        )
    return "cuda"


def launch(cfg: Config, run_dir: Path) -> dict | None:
    """Runs the job described by ``cfg``; returns rank 0's results (None in spawned mode)."""
    if cfg.resume:  # checked here, in one process, before anything is overwritten
        path = checkpoint.locate(cfg.resume)
        checkpoint.check_resumable(checkpoint.load(path), cfg)
        cfg.resume, run_dir = str(path), path.parent  # the run goes on in its own directory
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _as_torchrun_worker(cfg, run_dir)
    distributed = cfg.mode.name in DISTRIBUTED_MODES
    device = resolve_device(cfg)
    _check_sync_batchnorm(cfg, device)
    guards.check_cpu_capacity(cfg, device)
    if distributed and cfg.dist.port:
        _check_port(cfg.dist.port)  # before any work; a free port is picked just before spawning
    if device == "cpu" and cfg.device == "auto" and distributed:
        log.info("no CUDA device: running %d CPU workers with gloo", cfg.gpus)
    elif device == "cpu" and cfg.device == "auto" and cfg.mode.name in ("dp", "split"):
        log.info(
            "no CUDA device: mode=%s runs its CPU equivalent in one process (DataParallel "
            "passes the whole batch through; split keeps both parts on the CPU)",
            cfg.mode.name,
        )
    data_dir = prepare(cfg.data.name, data_root(cfg), cfg.data.mirrors)  # before any worker exists
    guards.check_batch_fits(cfg, data_dir)
    if not distributed:
        return train(cfg, run_dir, data_dir, device)
    # Every worker logs its traceback to rank_<r>.log in the run directory (train.setup_logging).
    spawn(_spawned_worker, world_size(cfg), cfg, run_dir, data_dir, device, log_dir=run_dir, port=cfg.dist.port)
    return None


def _spawned_worker(rank: int, size: int, cfg: Config, run_dir: Path, data_dir: Path, device: str) -> None:
    _share_cpu(device, size)
    train(cfg, run_dir, data_dir, device, rank=rank, world_size=size, local_rank=rank)


def _as_torchrun_worker(cfg: Config, run_dir: Path) -> dict:
    die_with_parent()  # the agent: a worker whose agent was killed must not train on alone
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if cfg.mode.name not in DISTRIBUTED_MODES:
        raise ConfigError(
            f"torchrun starts {size} processes but mode={cfg.mode.name} runs one; use mode=ddp or mode=torch_ddp"
        )
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    _check_sync_batchnorm(cfg, device)
    _share_cpu(device, local_size)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=cfg.dist.timeout_s))
    run_dir = rundir.on_this_node(run_dir)  # rank 0's Hydra chose it (see __main__); each node creates it
    if local_rank == 0:
        prepare(cfg.data.name, data_root(cfg), cfg.data.mirrors)
    dist.barrier()  # the other local ranks open the files only once they are complete
    guards.check_batch_fits(cfg, raw_dir(cfg.data.name, data_root(cfg)))
    return train(
        cfg, run_dir, raw_dir(cfg.data.name, data_root(cfg)), device, rank=rank, world_size=size, local_rank=local_rank
    )


def _share_cpu(device: str, processes: int) -> None:
    # N processes on one CPU each default to all cores: oversubscribed threads make every rank slow.
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def _check_sync_batchnorm(cfg: Config, device: str) -> None:
    # torch's SyncBatchNorm all-reduces its statistics only for accelerator tensors: on CPU its forward
    # raises and torch DDP refuses it, so say so before anything starts.
    if cfg.mode.sync_batchnorm and device == "cpu" and cfg.mode.name in DISTRIBUTED_MODES:
        raise ConfigError(
            "mode.sync_batchnorm=true needs CUDA: torch's SyncBatchNorm does not run on CPU "
            "tensors; use mode.sync_batchnorm=false on CPU"
        )


def _check_port(port: int) -> None:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(f"dist.port={port} is in use on 127.0.0.1; pass dist.port=0 to pick a free one") from None
