"""Applying a mode to a plain model (the one place where distribution enters the model), and starting
the processes that run it.

Usable from your own script, with nothing of MNIST (see examples/ddp_regression.py)::

    from mnist_dist.parallel import DistributedDataParallel, spawn

    def worker(rank: int, world_size: int) -> None:
        dist.init_process_group("gloo")  # spawn set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
        model = DistributedDataParallel(MyNet())
        ...

    if __name__ == "__main__":
        spawn(worker, 2)
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.config import DISTRIBUTED_MODES, ModeConfig
from mnist_dist.parallel.ddp import DistributedDataParallel
from mnist_dist.parallel.dp import FunctionalDataParallel, data_parallel, split

__all__ = [
    "DistributedDataParallel",
    "wrap_model",
    "unwrap",
    "plain_state_dict",
    "gradient_sync",
    "spawn",
    "WorkerFailed",
]

_WRAPPERS = (DistributedDataParallel, TorchDDP, nn.DataParallel, FunctionalDataParallel)


def wrap_model(model: nn.Module, mode: ModeConfig, device: torch.device, gpus: int = 1) -> nn.Module:
    """Places ``model`` and wraps it for ``mode``; the process group must exist for ddp modes.

    ``device`` is this process's device (cuda:<local rank> or cpu); dp and split use ``gpus`` devices.
    """
    if mode.name == "split":
        first, second = (
            ("cuda:0", "cuda:1") if device.type == "cuda" and gpus > 1 else ("cpu", device)
        )  # one GPU: the tutorial's CPU + GPU example; no GPU: both on the CPU
        return split(model, mode.split_at, torch.device(first), torch.device(second))
    model = model.to(device)
    if mode.sync_batchnorm and mode.name in DISTRIBUTED_MODES:
        # Before wrapping, so that the wrapper registers the converted layers (same parameters).
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if mode.name == "dp":
        device_ids = list(range(gpus)) if device.type == "cuda" else []  # [] : a pass-through on CPU
        return data_parallel(model, device_ids, mode.dp_block, mode.dp_functional)
    if mode.name == "ddp":
        return DistributedDataParallel(
            model,
            message_size=mode.message_size,
            overlap=mode.overlap,
            find_unused_parameters=mode.find_unused_parameters,
            compress_bf16=mode.compress_bf16,
        )
    if mode.name == "torch_ddp":
        return TorchDDP(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=mode.find_unused_parameters,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an outer wrapper, for evaluation without wrapper machinery."""
    return model.module if isinstance(model, _WRAPPERS) else model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict the plain model would have: no ``module.`` from a wrapper, outer or inner
    (dp_block wraps a submodule), so checkpoints load into the bare model class."""
    model = unwrap(model)
    inner = [f"{name}." for name, m in model.named_modules() if name and isinstance(m, _WRAPPERS)]
    state = {}
    for key, value in model.state_dict().items():
        for prefix in inner:
            if key.startswith(prefix + "module."):
                key = prefix + key[len(prefix + "module.") :]
        state[key] = value
    return state


def gradient_sync(model: nn.Module) -> Callable[[], None]:
    """What the training step calls between backward and optimizer.step().

    Only our DDP needs it; torch DDP finishes its all-reduce inside backward.
    """
    if isinstance(model, DistributedDataParallel):
        return model.finish_gradient_sync
    return lambda: None


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank."""


def spawn(fn: Callable[..., object], world_size: int, *args, log_dir: Path | str | None = None, port: int = 0) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and waits for all of them.

    Each process has MASTER_ADDR=127.0.0.1, MASTER_PORT (``port``, or a free one if 0), RANK and
    WORLD_SIZE in its environment, so ``dist.init_process_group(backend)`` needs no arguments. ``fn``
    and ``args`` must be picklable (``fn`` defined at module level; in a script, call ``spawn`` under
    ``if __name__ == "__main__":``); what ``fn`` returns is ignored.

    A worker that fails stops the whole job: the others are terminated (no rank is left hanging in a
    collective, pytorch/pytorch#17113) and WorkerFailed names the rank that failed first, with its log
    ``<log_dir>/rank_<r>.log`` if ``fn`` writes one there; without ``log_dir`` a failing worker prints
    its traceback to stderr. Ctrl-C in the parent stops every worker too.
    """
    port = port or _free_port()
    context = mp.get_context("spawn")
    # One pipe per worker for its failure report (a queue's semaphores would leak if a rank is killed).
    reports, report_ends = zip(*(context.Pipe(duplex=False) for _ in range(world_size)))
    workers = [
        context.Process(
            target=_worker,
            name=f"rank_{rank}",
            args=(fn, rank, world_size, port, args, log_dir is None, report_ends[rank]),
        )
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    try:
        _supervise(workers, reports, log_dir)
    finally:
        _stop(workers)  # after a failure, or Ctrl-C in the parent: leave no orphans


def _worker(
    fn: Callable[..., object], rank: int, world_size: int, port: int, args: tuple, print_traceback: bool, report
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        fn(rank, world_size, *args)
    except BaseException as error:
        if print_traceback:  # else it is in the worker's log already
            traceback.print_exc()
        report.send((time.monotonic(), rank, f"{type(error).__name__}: {error}".splitlines()[0]))
        sys.exit(1)


def _supervise(workers: list, reports: tuple, log_dir: Path | str | None) -> None:
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
            where = f" (log: {log_dir}/rank_{rank}.log)" if log_dir is not None else ""
            raise WorkerFailed(f"rank {rank} failed: {reason}{where}")


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


def _free_port() -> int:
    # Bind to port 0 and let the OS choose: a fixed port collides with the previous run still in
    # TIME_WAIT or another job ("Address already in use", pytorch/pytorch#11324).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
