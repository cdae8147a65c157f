"""The supervisor of a job ``spawn`` started: waits for its workers and, when one fails, names the rank at
the root of the failure (from their reports, exit codes and heartbeat slots); then stops the rest."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import time
from multiprocessing.connection import wait

_TIMED_OUT = re.compile(r"time[ds]? ?out", re.IGNORECASE)  # gloo: "Timed out waiting", NCCL: "timeout"
_NEVER_JOINED = "and they never joined it"  # our DistributedDataParallel's wait for the other ranks (ddp.py)


class Beat(ctypes.Structure):
    """Where a worker is, in memory its launcher reads: written by ``heartbeat``, read when the job fails."""

    _fields_ = [("step", ctypes.c_int64), ("phase", ctypes.c_char * 32)]


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank."""


def supervise(workers: list, reports: tuple, beats: list, log_path: str | None, start_method: str) -> None:
    """Waits for every worker; when one fails, raises WorkerFailed naming the rank at the root of it.

    When one rank fails its peers fail too, a moment later, in their next collective ("connection
    closed by peer"), and report that. So: a rank that died without reporting (a signal, the OOM
    killer) is the cause, since a peer's failure makes a rank raise, not vanish; otherwise the
    earliest report, by the time stamp each rank took as it failed; but if that report is a timeout, a
    rank still running that it waited for is the cause (the earliest in its heartbeat, a stopped one
    first). Workers that all vanish with their forkserver are the server's failure, not a rank's.
    """
    running = list(workers)
    while running:
        wait([worker.sentinel for worker in running])
        running = [worker for worker in running if worker.exitcode is None]
        failed = [rank for rank, worker in enumerate(workers) if worker.exitcode not in (None, 0)]
        if not failed:
            continue
        reported = sorted(report.recv() for report in reports if report.poll())
        silent = [rank for rank in failed if rank not in {r for _, r, _ in reported}]
        # multiprocessing says 255 for a forkserver worker whose server closed its status pipe, i.e. died.
        server = _dead_forkserver() if start_method == "forkserver" and workers[failed[0]].exitcode == 255 else None
        if server:
            raise WorkerFailed(
                f"the forkserver process that starts the workers was {server} (the OOM killer?), and rank "
                f"{silent[0]} with it: run the job again (a new server starts); with fewer workers if memory is short"
            )
        if silent:
            rank = silent[0]
            raise WorkerFailed(
                f"rank {rank} failed: {_exit_reason(workers[rank].exitcode)}{_aborted(workers, beats, rank)}"
                f"{_log_of(log_path, rank)}"
            )
        _, rank, reason = reported[0]
        timed_out = _TIMED_OUT.search(reason)
        stuck = _unresponsive(workers, beats) if timed_out or _NEVER_JOINED in reason else None
        stopped = stuck is not None and _stopped(workers[stuck].pid)
        if stuck is not None and (timed_out or stopped):  # else our DDP waited for live ranks that ran other steps
            state = "; its process is stopped, e.g. by SIGSTOP" if stopped else ""
            raise WorkerFailed(
                f"rank {stuck} stopped responding (last seen: {_last_seen(beats[stuck])}{state}); rank {rank} "
                f"timed out waiting for it: {reason}{_log_of(log_path, stuck)}"
            )
        raise WorkerFailed(f"rank {rank} failed: {reason}{_log_of(log_path, rank)}")


def _aborted(workers: list, beats: list, rank: int) -> str:
    """For a rank killed by SIGABRT while another still runs: NCCL's watchdog aborts a rank whose collective
    waited ``dist.timeout_s``, so the rank still running is the likely cause, and is named."""
    stuck = _unresponsive(workers, beats) if workers[rank].exitcode == -signal.SIGABRT else None
    if stuck is None:
        return ""
    return (
        f" (NCCL's watchdog aborts a rank whose collective waited dist.timeout_s for another: "
        f"rank {stuck} is still running (last seen: {_last_seen(beats[stuck])}))"
    )


def _log_of(log_path: str | None, rank: int) -> str:
    """`` (log: <path>)`` if the rank's log is there: a rank that failed before opening it has no log to read."""
    path = None if log_path is None else log_path.format(rank=rank)
    return f" (log: {path})" if path and os.path.isfile(path) else ""


def _unresponsive(workers: list, beats: list) -> int | None:
    """Of the ranks still running, the one a timed-out peer waited for: a stopped one, else the one whose
    heartbeat is furthest behind."""
    alive = [rank for rank, worker in enumerate(workers) if worker.exitcode is None]
    return min(alive, key=lambda rank: (not _stopped(workers[rank].pid), beats[rank].step), default=None)


def _last_seen(beat: Beat) -> str:
    phase = beat.phase.decode(errors="replace") or "no heartbeat"
    return f"{phase} after step {beat.step}" if beat.step else phase


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): its state in /proc (Linux; else False)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _dead_forkserver() -> str | None:
    """How the forkserver died if it did ("killed by SIGKILL"), else None. Its status is only peeked at
    (WNOWAIT): multiprocessing reaps it, and starts a new one at the next spawn."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # no public way to ask
    if pid is None:
        return None
    # A dying process closes its files before its parent can wait for it: give it a moment to finish dying.
    deadline = time.monotonic() + 2.0
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is not None:
            break
        if time.monotonic() > deadline:
            return None  # alive: a worker did exit with 255
        time.sleep(0.01)
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    return _exit_reason(-info.si_status if killed else info.si_status)


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def stop(workers: list, grace_s: float = 5.0) -> None:
    workers = [worker for worker in workers if worker.pid is not None]  # Ctrl-C may come before every start
    for worker in workers:
        if worker.is_alive():
            worker.terminate()  # SIGTERM first: a rank blocked in a collective dies at once
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()  # SIGTERM waits while a process is stopped; SIGKILL does not
            worker.join()
        # Closes this end of the worker's pipe to the launcher: a worker that outlived a killed forkserver
        # (which reported it gone) sees it close and kills itself (spawn.py's _exit_with_launcher).
        worker.close()
