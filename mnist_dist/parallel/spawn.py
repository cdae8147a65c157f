"""Starting and supervising the worker processes of a job on one machine."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch.multiprocessing as mp


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank."""


def spawn(fn: Callable[..., object], world_size: int, *args, log_path: str | None = None, port: int = 0) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and waits for all of them.

    Each process has MASTER_ADDR=127.0.0.1, MASTER_PORT (``port``, or a free one if 0), RANK and
    WORLD_SIZE in its environment, so ``dist.init_process_group(backend)`` needs no arguments. ``fn``
    and ``args`` must be picklable (``fn`` defined at module level; in a script, call ``spawn`` under
    ``if __name__ == "__main__":``); what ``fn`` returns is ignored.

    A worker that fails stops the whole job: the others are terminated (no rank is left hanging in a
    collective, pytorch/pytorch#17113) and WorkerFailed names the rank that failed first, with its log
    ``log_path.format(rank=rank)`` if ``fn`` writes one there (e.g. ``"run/rank_{rank}.log"``); without
    ``log_path`` a failing worker prints its traceback to stderr. Ctrl-C in the parent stops every worker too.
    """
    port = port or _free_port()
    context = mp.get_context("spawn")
    # One pipe per worker for its failure report (a queue's semaphores would leak if a rank is killed).
    reports, report_ends = zip(*(context.Pipe(duplex=False) for _ in range(world_size)))
    workers = [
        context.Process(
            target=_worker,
            name=f"rank_{rank}",
            args=(fn, rank, world_size, port, args, log_path is None, report_ends[rank]),
        )
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    try:
        _supervise(workers, reports, log_path)
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


def _supervise(workers: list, reports: tuple, log_path: str | None) -> None:
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
            where = f" (log: {log_path.format(rank=rank)})" if log_path is not None else ""
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
