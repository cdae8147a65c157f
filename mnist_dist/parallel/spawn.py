"""Starting a job's worker processes on one machine with torch's launcher (``start_processes``), and what it
does not do: a worker that dies with a SIGKILLed launcher, ranks that meet in a store off the network, Ctrl-C
answered by the launcher alone, and one line naming the failed rank."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_GRACE_S = 5.0  # after a rank failed: for the others to end on their own, then to end on SIGTERM


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names the rank, ``__cause__`` holds torch's report (a traceback)."""


def spawn(
    fn: Callable[..., object],
    world_size: int,
    *args,
    log_path: str | None = None,
    port: int = 0,
    start_method: str = "spawn",
) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` processes and waits for all of them.

    Each process has what torchrun sets in its environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT: ``port``, or a free one if 0): plain ``dist.init_process_group(backend)``
    meets in this process's TCPStore, which listens on 127.0.0.1 only; gloo and NCCL pair on loopback. No port
    of the job is reachable from the network. ``fn`` and ``args`` must be picklable (in a script, call ``spawn``
    under ``if __name__ == "__main__":``).

    A worker that fails stops the whole job: WorkerFailed names its rank and reason in one line, with its log
    ``log_path.format(rank=rank)`` if ``fn`` wrote one. A worker dies with this process, even a SIGKILLed one.
    Ctrl-C is this process's alone: the workers ignore it, and are stopped with SIGTERM.

    ``start_method="forkserver"`` forks the workers from one server that imported torch and ``fn``'s module
    once (a fraction of a second per worker instead of several); it serves every later call. CPU work only: a
    forked process cannot use a CUDA driver its parent loaded.
    """
    store = _loopback_store(port)
    if start_method == "forkserver":  # only the first call's list counts: it starts the server
        mp.get_context("forkserver").set_forkserver_preload(["torch", __name__, fn.__module__])
    environment = dict(
        os.environ,  # now: a forkserver's worker would otherwise have the server's, from when it started
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # Every rank connects to this process's store instead of rank 0 serving one on all interfaces.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # Pair sockets on loopback: by default gloo and NCCL listen on the host name's address.
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
    )
    with _sigint_held_from_children():
        context = mp.start_processes(
            _worker, (fn, environment, args), world_size, join=False, start_method=start_method
        )
    try:
        while not context.join(grace_period=_GRACE_S):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        raise WorkerFailed(_reason(error, log_path)) from error
    finally:
        _stop(context.processes)  # after Ctrl-C in this process: leave no worker
        del store  # closes the listening socket


def _worker(rank: int, fn: Callable[..., object], environment: dict[str, str], args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher answers Ctrl-C (see _sigint_held_from_children)
    die_with_parent()
    os.environ.clear()
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank))
    fn(rank, int(environment["WORLD_SIZE"]), *args)


def _reason(error: mp.ProcessRaisedException | mp.ProcessExitedException, log_path: str | None) -> str:
    """``rank <r> failed: <its exception's line, or how it ended>`` and its log; after a timeout, the likely cause."""
    rank = error.error_index
    if isinstance(error, mp.ProcessExitedException):
        signal_name = error.signal_name
        reason = f"killed by {signal_name}" if signal_name else f"exited with code {error.exit_code}"
    else:  # a traceback: the exception's line follows the last frame's indented lines
        lines = error.msg.rstrip().splitlines()
        reason = lines[max(i for i, line in enumerate(lines) if line.startswith(" ")) + 1]
    if "timed out" in reason.lower():
        reason += (
            " (the process group's timeout, dist.timeout_s: another rank is stuck, or the ranks ran different numbers "
            "of steps; give every rank the same number of batches, or train inside join())"
        )
    path = None if log_path is None else log_path.format(rank=rank)
    log = f" (log: {path})" if path and os.path.isfile(path) else ""  # a rank may fail before opening its log
    return f"rank {rank} failed: {reason}{log}"


def _stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM first: a rank blocked in a collective dies at once
    for process in processes:
        process.join(_GRACE_S)
        if process.is_alive():
            process.kill()  # SIGTERM waits while a process is stopped; SIGKILL does not
            process.join()


@contextlib.contextmanager
def _sigint_held_from_children() -> Iterator[None]:
    """SIGINT blocked in this thread while the body runs, and so for good in every process it starts (a mask
    survives fork and exec), a forkserver still importing torch included; a Ctrl-C that came meanwhile is
    delivered here when the body ends. A terminal signals the whole process group: each worker would print a
    KeyboardInterrupt traceback. This process answers it alone (stopping the workers with SIGTERM)."""
    # multiprocessing's resource tracker, started with the first process, unblocks SIGINT after starting
    # itself: started first, it cannot undo the mask below.
    multiprocessing.resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def die_with_parent() -> None:
    """Has the kernel SIGKILL this process when its parent (a launcher, a torchrun agent, a forkserver, which
    exits with its launcher) dies (Linux; elsewhere a no-op): it would otherwise train on with nobody to
    report to, or hang in a collective. torch's launcher asks for SIGINT, which a worker here ignores."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


def _loopback_store(port: int) -> dist.TCPStore:
    """The job's rendezvous store, served from this process on 127.0.0.1:``port`` (0: a free one, held until the
    job ends: a fixed port collides with a run in TIME_WAIT, pytorch/pytorch#11324). TCPStore binds every
    interface when it opens its own socket, so it gets one bound to loopback."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen()
    return dist.TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        is_master=True,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns and closes it
    )
