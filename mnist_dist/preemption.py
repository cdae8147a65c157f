"""Stopping on a scheduler's warning: write a checkpoint and exit, so that the requeued job goes on.

SLURM sends SIGUSR1 before the time limit when asked (``#SBATCH --signal=USR1@90``, as submitit does)
and SIGTERM when it cancels or preempts a job. Under srun the handler only notes the signal; the
worker asks every ``log_every`` steps whether any rank got one (a collective, so every rank stops
after the same step, even if the signal reached only some), saves, and exits with ``REQUEUE``.
"""

from __future__ import annotations

import signal

import torch.distributed as dist

from mnist_dist.metrics import all_reduce

REQUEUE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run the same command again to go on
_received: list[str] = []
_installed: list[bool] = []


class Stopped(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error, so not an Exception)
    """A scheduler asked this job to stop; the checkpoint is written. The message says where it is."""


def install() -> None:
    """From now on SIGUSR1 and SIGTERM stop the run at its next check instead of killing it."""
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, lambda received, frame: _received.append(signal.Signals(received).name))
    _installed.append(True)


def requested(step: int, every: int) -> str | None:
    """The signal that asks to stop, if any rank got one: checked at every ``every``-th step (a
    collective: every rank calls with the same ``step``)."""
    if not _installed or step % every:
        return None
    (anyone,) = all_reduce([float(bool(_received))], op=dist.ReduceOp.MAX)
    return (_received or ["a signal to another rank"])[0] if anyone else None
