"""Stopping at the next step boundary with a checkpoint: on Ctrl-C, on SIGTERM (a scheduler's, or the launcher
passing a Ctrl-C on to its ranks) and on SIGUSR1 (SLURM's warning before the time limit).

Before the first step there is nothing new to save: the run stops at once. From then on each rank votes
after every step on whether any rank got a signal (so every rank stops after the same step, even if the
signal reached only some); a vote is read one step later, so no step waits for it. A second Ctrl-C stops
at once. Under srun the job then exits ``REQUEUE``; otherwise it prints the command that resumes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mnist_dist.operations.errors import stop_now

REQUEUE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run the same command again to go on
_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)
_GRACE_S = 5.0  # for the handler to stop the job before the watching thread does
_BEFORE_TRAINING = "stopped by {} before the first step: nothing new to save"
_received: list[str] = []
_last: list[str] = []  # the signal that stopped the last run, once its handlers are put back
_training: list[bool] = []  # the first step is done: a signal is voted on, not acted on at once
_votes: list = []  # the last step's vote: (its all-reduce, its tensor)
_group: list = []  # the process group the votes go through (gloo: no device sync for one number)
_timeout: list[timedelta] = []  # how long a vote waits for a stuck rank


class Stopped(KeyboardInterrupt):  # noqa: N818 (a Ctrl-C, answered: whoever handles Ctrl-C handles it)
    """A signal asked this run to stop; the checkpoint is written. The message says where it is."""


def received() -> int | None:
    """The signal that the last run in this process got, if any (one after its last step stopped nothing)."""
    return signal.Signals[_last[0]] if _last else None


@contextmanager
def installed(timeout_s: float) -> Iterator[None]:
    """Within it these signals stop the run: at once before the first step, else after a vote that waits at
    most ``timeout_s`` (dist.timeout_s). The handlers and this module's state are put back afterwards: a sweep
    runs several jobs in one process."""
    handled: list[bool] = []  # the handler raised Stopped: the main thread is on its way out

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGINT and signal.Signals.SIGINT.name in _received:
            stop_now(signum)  # Ctrl-C again: at once
        _received.append(signal.Signals(signum).name)
        if not _training:
            handled.append(True)
            raise Stopped(_BEFORE_TRAINING.format(_received[0]))

    _timeout[:] = [timedelta(seconds=timeout_s)]
    before = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)  # the interpreter writes each signal
    threading.Thread(target=_watch_start_up, args=(read_end, handled), name="preemption_watch", daemon=True).start()
    try:
        for signum, handler in before.items():
            if handler is not signal.SIG_IGN:  # a spawned rank leaves Ctrl-C to its launcher
                signal.signal(signum, on_signal)
        yield
    finally:
        handled.append(True)  # left: a watcher still in its grace must not end a process that went on
        signal.set_wakeup_fd(wakeup)
        os.close(write_end)  # the watching thread reads the end of the pipe and ends
        for signum, handler in before.items():
            signal.signal(signum, handler)
        _last[:] = _received[:1]
        for state in (_received, _training, _votes, _group):
            state.clear()


def _watch_start_up(read_end: int, handled: list[bool]) -> None:
    """Ends the process with REQUEUE if a signal before the first step finds the main thread inside torch's
    C++ (a rendezvous waits up to ``dist.timeout_s``), where no Python handler runs, for ``_GRACE_S``."""
    while received := os.read(read_end, 64):
        if _training or not {signal.Signals(n) for n in received} & set(_SIGNALS):
            continue
        time.sleep(_GRACE_S)
        if not handled and not _training:
            os.write(2, f"{_BEFORE_TRAINING.format(signal.Signals(received[-1]).name)}\n".encode())
            os._exit(REQUEUE)
    os.close(read_end)


def requested(step: int) -> str | None:
    """Called on every rank after each step (a collective in a process group): the signal that asks to stop,
    if any rank got one by the step before (by this step, with one process)."""
    _training[:] = [True]
    if not dist.is_initialized():
        return _received[0] if _received else None
    if not _group:
        # One number a step: through gloo, even in an NCCL job, so that reading it never syncs the GPU.
        gloo = dist.get_backend() == "gloo"
        _group.append(None if gloo else dist.new_group(backend="gloo", timeout=_timeout[0]))
    vote = torch.tensor([float(bool(_received))])
    work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_group[0], async_op=True)
    previous, _votes[:] = _votes[:], [(work, vote)]
    if not previous:
        return None
    ((work, tally),) = previous
    work.wait()
    return (_received or ["a signal to another rank"])[0] if tally.item() else None
