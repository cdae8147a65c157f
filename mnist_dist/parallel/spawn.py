"""A job's workers on one machine, started by torch's launcher, with what it does not do: a store in a file (no
socket), workers that die with a SIGKILLed launcher, Ctrl-C answered by the launcher alone, one line per failure."""

from __future__ import annotations

import ctypes
import multiprocessing.resource_tracker
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_GRACE_S = 5.0  # after a rank failed: for the others to end on their own, then on SIGTERM


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank, ``__cause__`` holds torch's report (a traceback)."""


def spawn(
    fn: Callable[..., object], world_size: int, *args, log_dir: str | None = None, start_method: str = "spawn"
) -> None:
    """Runs ``fn(rank, world_size, *args)`` (picklable) in ``world_size`` processes (torch's ``start_processes``) and
    waits. Each has torchrun's variables and MNIST_DIST_INIT_METHOD, a store file in ``log_dir`` (None: the temp
    folder). WorkerFailed names a failed rank, why and its log ``<log_dir>/rank_<r>.log``. forkserver: CPU only."""
    if start_method == "forkserver":  # only the first call's list counts: it starts the server
        mp.get_context("forkserver").set_forkserver_preload(["torch", __name__, fn.__module__])
    # A folder of its own: a resume goes on in its run's directory, where a killed job may have left its store.
    with tempfile.TemporaryDirectory(prefix=".store_", dir=log_dir, ignore_cleanup_errors=True) as store:
        environment = dict(  # now: a forkserver's worker would otherwise have the server's, from when it started
            os.environ,
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            # A file, not env://'s TCPStore, which rank 0 would serve on every interface even when given 127.0.0.1.
            MNIST_DIST_INIT_METHOD=f"file://{os.path.abspath(store)}/store",
            # Pair sockets on loopback: by default gloo and NCCL listen on the host name's address.
            GLOO_SOCKET_IFNAME="lo",
            NCCL_SOCKET_IFNAME="lo",
        )
        # SIGINT blocked while they start, and so for good in them (a mask survives fork and exec), a forkserver
        # importing torch included: a terminal signals the whole process group, and each would print a traceback.
        # A Ctrl-C meanwhile is delivered here after. The resource tracker unblocks it after starting: it goes first.
        multiprocessing.resource_tracker.ensure_running()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            context = mp.start_processes(
                _worker, (fn, environment, args), world_size, join=False, start_method=start_method
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:  # after a failure, join ends the others: SIGTERM after _GRACE_S, SIGKILL (a stopped one) after another
            while not context.join(grace_period=_GRACE_S):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            raise WorkerFailed(_reason(error, log_dir)) from error
        except KeyboardInterrupt:  # passed on as SIGTERM: a rank that handles it stops at its next step boundary
            for process in context.processes:
                process.terminate()
            for process in context.processes:  # another Ctrl-C ends this process at once, and the workers with it
                process.join()
            raise
        finally:  # a failed rank's traceback file, which torch leaves in the temp folder (see pytorch/pytorch#169258)
            for path in context.error_files:
                Path(path).unlink(missing_ok=True)


def _worker(rank: int, fn: Callable[..., object], environment: dict[str, str], args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher answers Ctrl-C (SIGINT is blocked in it too)
    # Dies with the launcher, SIGKILL included: the launcher's end of the pipe to it closes. (A parent-death
    # signal would watch a forkserver, which outlives the launcher while its workers hold a pipe to it.)
    launcher = multiprocessing.parent_process().sentinel

    def exit_with_launcher() -> None:
        wait([launcher])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=exit_with_launcher, name="exit_with_launcher", daemon=True).start()
    os.environ.clear()
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank))
    fn(rank, int(environment["WORLD_SIZE"]), *args)


def _reason(error: mp.ProcessRaisedException | mp.ProcessExitedException, log_dir: str | None) -> str:
    """``rank <r> failed: <its exception's line, or how it ended>`` and its log; after a timeout, the likely cause."""
    rank = error.error_index
    if isinstance(error, mp.ProcessExitedException):
        reason = f"killed by {error.signal_name}" if error.signal_name else f"exited with code {error.exit_code}"
    else:  # a traceback: the exception's line follows the last frame's indented lines
        lines = error.msg.rstrip().splitlines()
        reason = lines[max(i for i, line in enumerate(lines) if line.startswith(" ")) + 1]
    if peer_ended := "closed by peer" in reason:  # gloo: a rank that timed out may exit after the peer it left
        reason += " (another rank ended first: its log says why)"
    if peer_ended or "timed out" in reason.lower() or reason == "killed by SIGABRT":  # SIGABRT: NCCL's watchdog
        reason += (
            " (if it waited in a collective for dist.timeout_s: another rank is stuck, or the ranks ran different "
            "numbers of steps; give every rank the same number of batches, or train inside join())"
        )
    path = None if log_dir is None else os.path.join(log_dir, f"rank_{rank}.log")
    log = f" (log: {path})" if path and os.path.isfile(path) else ""  # a rank may fail before opening its log
    return f"rank {rank} failed: {reason}{log}"


def die_with_parent() -> None:
    """Has the kernel SIGKILL this process when its parent (a torchrun agent) dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
