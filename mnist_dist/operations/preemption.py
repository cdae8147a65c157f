"""Stopping at a step boundary with a checkpoint on Ctrl-C, SIGTERM (a scheduler's, or a launcher passing on a Ctrl-C)
and SIGUSR1 (SLURM's warning); before the first step at once, with nothing new to save. After it every rank votes after
each step, read a step later so that no step waits, and all stop after the same step. A second Ctrl-C stops at once."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mnist_dist.operations.errors import received

REQUEUE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run the same command again to go on
_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)
_received: list[str] = []  # this run's signals, by name
_training: list[bool] = []  # the first step is done: a signal is voted on, not acted on at once
_votes: list = []  # the votes not yet read: (its all-reduce, its tensor)
_group: list = []  # the process group the votes go through (gloo: no device sync for one number)
_timeout: list[timedelta] = []  # how long a vote waits for a stuck rank


class Stopped(KeyboardInterrupt):  # noqa: N818 (a Ctrl-C, answered: whoever handles Ctrl-C handles it)
    """A signal asked this run to stop; the checkpoint is written. The message says where it is."""


@contextmanager
def installed(timeout_s: float) -> Iterator[None]:
    """Within it these signals stop the run, a vote waiting at most ``timeout_s`` for a stuck rank. The handlers and
    this module's state are put back afterwards: a sweep runs several jobs in one process."""

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGINT and "SIGINT" in _received:
            before[signum](signum, frame)  # Ctrl-C again: the command's own handler, at once
        _received.append(signal.Signals(signum).name)
        received.append(signum)  # the command's exit status
        if not _training:
            raise Stopped(f"stopped by {_received[0]} before the first step: nothing new to save")

    _timeout[:] = [timedelta(seconds=timeout_s)]
    before = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    try:
        for signum, handler in before.items():
            if handler is not signal.SIG_IGN:  # a spawned rank leaves Ctrl-C to its launcher
                signal.signal(signum, on_signal)
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for state in (_received, _training, _votes, _group):
            state.clear()


def requested() -> str | None:
    """Called on every rank after each step (a collective in a process group): the signal that asks to stop,
    if any rank got one by the step before (by this step, with one process)."""
    _training[:] = [True]
    if not dist.is_initialized():
        return _received[0] if _received else None
    if not _group:  # one number a step: through gloo, even in an NCCL job, so that reading it never syncs the GPU
        _group.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=_timeout[0]))
    vote = torch.tensor([float(bool(_received))])
    _votes.append((dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_group[0], async_op=True), vote))
    if len(_votes) == 1:
        return None
    work, tally = _votes.pop(0)
    work.wait()
    return (_received or ["a signal to another rank"])[0] if tally.item() else None
