"""Stopping on a scheduler's warning (SIGUSR1 before the time limit, SIGTERM on preemption) under srun:
write a checkpoint and exit ``REQUEUE``, so that the requeued job goes on (docs/running.md).

Before the first step there is nothing new to save: the job stops at once. From then on each rank votes
after every step on whether any rank got a signal (so every rank stops after the same step, even if the
signal reached only some); a vote is read one step later, so no step waits for it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

REQUEUE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run the same command again to go on
_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_GRACE_S = 5.0  # for the handler to stop the job before the watching thread does
_BEFORE_TRAINING = (  # the one line of a job stopped by a signal before the first step
    "stopped by {} before the first step: nothing new to save; start the job again (resume=auto goes on from the "
    "last checkpoint)"
)
_received: list[str] = []
_installed: list[bool] = []
_training: list[bool] = []  # the first step is done: a signal is voted on, not acted on at once
_votes: list = []  # the last step's vote: (its all-reduce, its tensor)
_group: list = []  # the process group the votes go through (gloo: no device sync for one number)


class Stopped(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error, so not an Exception)
    """A scheduler asked this job to stop; the checkpoint is written. The message says where it is."""


def install() -> None:
    """From now on SIGUSR1 and SIGTERM stop the run: at once before the first step, else after a vote."""
    handled: list[bool] = []  # the handler raised Stopped: the main thread is on its way out

    def on_signal(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        _received.append(name)
        if not _training:
            handled.append(True)
            raise Stopped(_BEFORE_TRAINING.format(name))

    for signum in _SIGNALS:
        signal.signal(signum, on_signal)
    _watch_start_up(handled)
    _installed.append(True)


def _watch_start_up(handled: list[bool]) -> None:
    """Ends the process with REQUEUE if a signal before the first step finds the main thread inside torch's
    C++ (a rendezvous waits up to ``dist.timeout_s``), where no Python handler runs, for ``_GRACE_S``."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)  # the interpreter writes each signal's number

    def watch() -> None:
        while received := os.read(read_end, 64):
            if _training or not {signal.Signals(n) for n in received} & set(_SIGNALS):
                continue
            time.sleep(_GRACE_S)
            if not handled:
                os.write(2, f"{_BEFORE_TRAINING.format(signal.Signals(received[-1]).name)}\n".encode())
                os._exit(REQUEUE)

    threading.Thread(target=watch, name="preemption_watch", daemon=True).start()


def requested(step: int) -> str | None:
    """Called on every rank after each step (a collective when installed): the signal that asks to stop,
    if any rank got one by the step before."""
    if not _installed:
        return None
    if not _group:
        # One number a step: through gloo, even in an NCCL job, so that reading it never syncs the GPU.
        _group.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    _training[:] = [True]
    vote = torch.tensor([float(bool(_received))])
    work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_group[0], async_op=True)
    previous, _votes[:] = _votes[:], [(work, vote)]
    if not previous:
        return None
    ((work, tally),) = previous
    work.wait()
    return (_received or ["a signal to another rank"])[0] if tally.item() else None
