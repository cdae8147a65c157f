"""Starting the worker processes of a job on one machine, and what a worker calls (``init_process_group``,
``heartbeat``); ``_supervise`` watches them and names the rank at the root of a failure."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist
import torch.multiprocessing as mp

from mnist_dist.parallel._supervise import Beat, stop, supervise

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What every worker of a forkserver job has imported before it starts: torch, and torch._dynamo, which
# torch.optim imports at the first step. A fresh interpreter pays ~7 s of CPU for the two.
_PRELOAD = ("torch", "torch._dynamo")

_beat: list[Beat] = []  # in a worker: its slot


def spawn(
    fn: Callable[..., object],
    world_size: int,
    *args,
    log_path: str | None = None,
    port: int = 0,
    start_method: str = "spawn",
) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and waits for all of them.

    Each process has MASTER_ADDR=127.0.0.1, MASTER_PORT (``port``, or a free one if 0), RANK and WORLD_SIZE
    in its environment: plain ``dist.init_process_group(backend)`` meets in this process's TCPStore, which
    listens on 127.0.0.1 only; gloo and NCCL use loopback. No port of the job is reachable from the network.
    ``fn`` and ``args`` must be picklable (in a script, call ``spawn`` under ``if __name__ == "__main__":``).

    A worker that fails stops the whole job (pytorch/pytorch#17113): WorkerFailed names the rank at the root
    of it, with its log ``log_path.format(rank=rank)`` if ``fn`` wrote one (without ``log_path`` a failing
    worker prints its traceback); a rank that stopped responding is named with its last ``heartbeat``. Ctrl-C
    in the parent, or its death, stops every worker (only this process answers SIGINT).

    ``start_method="forkserver"`` forks the workers from one server that imported torch, torch._dynamo and
    ``fn``'s module once (a fraction of a second per worker instead of several); it serves every later call.
    CPU work only: a forked process cannot use a CUDA driver its parent loaded. Each worker still gets this
    process's environment and working directory as they are at the call.
    """
    store = _loopback_store(port)
    context = mp.get_context(start_method)
    if start_method == "forkserver":  # only the first call's list counts: it starts the server
        context.set_forkserver_preload([*_PRELOAD, __name__, fn.__module__])
    # One pipe per worker for its failure report (a queue's semaphores would leak if a rank is killed).
    reports, report_ends = zip(*(context.Pipe(duplex=False) for _ in range(world_size)))
    beats = [context.RawValue(Beat) for _ in range(world_size)]
    env = dict(os.environ)
    workers = [
        context.Process(
            target=_worker,
            name=f"rank_{rank}",
            args=(fn, rank, world_size, store.port, args, log_path is None, report_ends[rank], beats[rank], env),
        )
        for rank in range(world_size)
    ]
    try:
        _start(workers, start_method)
        supervise(workers, reports, beats, log_path, start_method)
    finally:
        stop(workers)  # after a failure, or Ctrl-C in the parent: leave no orphans
        del store  # closes the listening socket


def heartbeat(phase: str, step: int | None = None) -> None:
    """Says where this worker is (``phase``: "training", "evaluation", ...; ``step``: the last finished,
    None: unchanged), for ``spawn`` to say if it stops responding. Two memory writes; a no-op outside spawn."""
    if _beat:
        if step is not None:
            _beat[0].step = step
        _beat[0].phase = phase.encode()[:31]


def _start(workers: list, start_method: str) -> None:
    """Starts the workers with SIGINT held from them (and from a forkserver, their parent)."""
    with _sigint_held_from_children():
        if start_method == "forkserver":
            multiprocessing.forkserver.ensure_running()  # the server (its workers' parent) starts now
        else:
            for worker in workers:
                worker.start()
    if start_method == "forkserver":  # waits for the server's imports: Ctrl-C stays this process's meanwhile
        try:
            for worker in workers:
                worker.start()
        except BaseException:
            _stop_forkserver()
            raise


def _stop_forkserver() -> None:
    """Kills the forkserver and waits for it: interrupted while it still imports torch, it would import on for
    seconds after this process exits, holding multiprocessing's resource tracker too. The next job starts a new one."""
    server = multiprocessing.forkserver._forkserver  # no public way to stop it
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()  # reaps it and forgets its address


@contextlib.contextmanager
def _sigint_held_from_children() -> Iterator[None]:
    """SIGINT blocked in this thread while the body runs, and so for good in every process it starts (a mask
    survives fork and exec); a Ctrl-C that came meanwhile is delivered here when the body ends. A terminal
    signals the whole process group: the workers, and a forkserver still importing torch, would each print a
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
    """Has the kernel SIGKILL this process when its parent (its supervisor: a torchrun agent) dies (Linux;
    elsewhere a no-op): it would otherwise train on with nobody to report to, or hang in a collective."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


def _exit_with_launcher() -> None:
    """Kills this worker when the process that started it exits, SIGKILL and the OOM killer included: a thread
    waits for the launcher's end of the worker's pipe to close. (The kernel's parent-death signal would watch
    the forkserver under forkserver, which outlives the launcher.)"""
    sentinel = multiprocessing.parent_process().sentinel

    def watch() -> None:
        wait([sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit_with_launcher", daemon=True).start()


def _worker(
    fn: Callable[..., object],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    print_traceback: bool,
    report,
    beat: Beat,
    environment: dict[str, str],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher answers Ctrl-C (see _sigint_held_from_children)
    _exit_with_launcher()
    _beat.append(beat)
    os.environ.clear()  # a forkserver's worker would otherwise have the server's, from when it started
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        # Every rank connects to the parent's store instead of rank 0 serving one on all interfaces.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # Pair sockets on loopback: by default gloo and NCCL listen on the host name's address.
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
    )
    try:
        fn(rank, world_size, *args)
    except BaseException as error:
        if print_traceback:  # else it is in the worker's log already
            traceback.print_exc()
        with contextlib.suppress(OSError):  # BrokenPipeError: the launcher is gone, nobody is left to tell
            report.send((time.monotonic(), rank, f"{type(error).__name__}: {error}".splitlines()[0]))
        sys.exit(1)


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
