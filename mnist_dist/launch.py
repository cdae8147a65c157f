"""The parent: choose the device, prepare the data once, then run the workers and watch them.

Three ways in, one worker (``mnist_dist.train.train``):

- single mode: the worker runs in this process;
- ddp modes: one spawned process per device, rendezvous on 127.0.0.1 at a free port;
- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set): this process *is* a worker; local rank 0 prepares
  the data while the others wait at a barrier. This is how the app runs across nodes.

A worker that fails stops the whole job: the others are terminated (no rank is left hanging in a
collective, pytorch/pytorch#17113), and the parent exits non-zero naming the rank and its error.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mnist_dist import checkpoint
from mnist_dist.config import DISTRIBUTED_MODES, Config, ConfigError, data_root, devices_needed, world_size
from mnist_dist.data import prepare, raw_dir
from mnist_dist.train import train

log = logging.getLogger("mnist_dist")


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank."""


def resolve_device(cfg: Config) -> str:
    """'cuda' or 'cpu' for ``cfg.device``, or a ConfigError that says what to change."""
    visible = torch.cuda.device_count()
    needed = devices_needed(cfg)
    if cfg.device == "cpu" or (cfg.device == "auto" and visible == 0):
        return "cpu"
    if visible < needed:
        raise ConfigError(f"device={cfg.device} needs {needed} CUDA device(s) for gpus={cfg.gpus} but "
                          f"{visible} are visible; use gpus={visible} or device=cpu" if visible else
                          f"device={cfg.device} but no CUDA device is visible; use device=cpu or device=auto")
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
    if distributed and cfg.dist.port:
        _check_port(cfg.dist.port)  # before any work; a free port is picked just before spawning
    if device == "cpu" and cfg.device == "auto" and distributed:
        log.info("no CUDA device: running %d CPU workers with gloo", cfg.gpus)
    elif device == "cpu" and cfg.device == "auto" and cfg.mode.name in ("dp", "split"):
        log.info("no CUDA device: mode=%s runs its CPU equivalent in one process (DataParallel "
                 "passes the whole batch through; split keeps both parts on the CPU)", cfg.mode.name)
    data_dir = prepare(cfg.data.name, data_root(cfg), cfg.data.mirrors)  # before any worker exists
    if not distributed:
        return train(cfg, run_dir, data_dir, device)
    port = cfg.dist.port or _free_port()
    spawn = mp.get_context("spawn")
    # One pipe per worker for its failure report (a queue's semaphores would leak if a rank is killed).
    reports, report_ends = zip(*(spawn.Pipe(duplex=False) for _ in range(world_size(cfg))))
    workers = [spawn.Process(target=_spawned_worker, name=f"rank_{rank}",
                             args=(rank, cfg, run_dir, data_dir, device, port, report_ends[rank]))
               for rank in range(world_size(cfg))]
    for worker in workers:
        worker.start()
    try:
        _supervise(workers, reports, run_dir)
    finally:
        _stop(workers)  # after a failure, or Ctrl-C in the parent: leave no orphans
    return None


def _spawned_worker(rank: int, cfg: Config, run_dir: Path, data_dir: Path, device: str, port: int,
                    report) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _share_cpu(device, cfg.gpus)
    try:
        train(cfg, run_dir, data_dir, device, rank=rank, world_size=cfg.gpus, local_rank=rank)
    except BaseException as error:  # the traceback is in rank_<r>.log already
        report.send((time.monotonic(), rank, f"{type(error).__name__}: {error}".splitlines()[0]))
        sys.exit(1)


def _supervise(workers: list, reports: tuple, run_dir: Path) -> None:
    """Waits for every worker; when one fails, raises WorkerFailed naming the rank at the root of it.

    When one rank fails its peers fail too, a moment later, in their next collective ("connection
    closed by peer"), and report that. So: a rank that died without reporting (a signal, the OOM
    killer) is the cause, since a peer's failure makes a rank raise, not vanish; otherwise the
    earliest report, by the time stamp each rank took as it failed.
    """
    running = list(workers)
    while running:
        wait([worker.sentinel for worker in running])
        running = [worker for worker in running if worker.exitcode is None]
        failed = [rank for rank, worker in enumerate(workers) if worker.exitcode not in (None, 0)]
        if failed:
            reported = sorted(report.recv() for report in reports if report.poll())
            silent = [rank for rank in failed if rank not in {r for _, r, _ in reported}]
            if silent:
                rank, reason = silent[0], _exit_reason(workers[silent[0]].exitcode)
            else:
                _, rank, reason = reported[0]
            raise WorkerFailed(f"rank {rank} failed: {reason} (log: {run_dir}/rank_{rank}.log)")


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _stop(workers: list, grace_s: float = 5.0) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()  # SIGTERM first: a rank blocked in a collective dies at once
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()


def _as_torchrun_worker(cfg: Config, run_dir: Path) -> dict:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if cfg.mode.name not in DISTRIBUTED_MODES:
        raise ConfigError(f"torchrun starts {size} processes but mode={cfg.mode.name} runs one; "
                          "use mode=ddp or mode=torch_ddp")
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    _share_cpu(device, local_size)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=timedelta(seconds=cfg.dist.timeout_s))
    # Only rank 0 had Hydra create a run directory (see __main__): everyone writes there.
    shared = [str(run_dir)]
    dist.broadcast_object_list(shared, src=0)
    run_dir = Path(shared[0])
    if local_rank == 0:
        prepare(cfg.data.name, data_root(cfg), cfg.data.mirrors)
    dist.barrier()  # the other local ranks open the files only once they are complete
    return train(cfg, run_dir, raw_dir(cfg.data.name, data_root(cfg)), device, rank=rank,
                 world_size=size, local_rank=local_rank)


def _share_cpu(device: str, processes: int) -> None:
    # N processes on one CPU each default to all cores: oversubscribed threads make every rank slow.
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def _check_port(port: int) -> None:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(f"dist.port={port} is in use on 127.0.0.1; pass dist.port=0 to pick a "
                              "free one") from None


def _free_port() -> int:
    # Bind to port 0 and let the OS choose: a fixed port collides with the previous run still in
    # TIME_WAIT or another job ("Address already in use", pytorch/pytorch#11324).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
