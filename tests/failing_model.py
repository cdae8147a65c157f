"""A narrow convnet, and one that misbehaves on one rank at one training step: for the tests of processes, files
and failures, which a run's arithmetic does not change (the default convnet's 1.2 M weights cost most of a run)."""

import os
import signal
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

from mnist_dist.model import ConvNet


class NarrowConvNet(ConvNet):
    """ConvNet's layers and dropout, an eighth of its channels: the same module names, a fiftieth of the work."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.features[0], self.features[2] = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.classifier[0], self.classifier[3] = nn.Linear(8 * 12 * 12, 32), nn.Linear(32, 10)


class FailingConvNet(NarrowConvNet):
    """At training step ``fail_step`` on rank ``fail_rank`` (-1: never): raise, or with ``kill`` die
    by SIGKILL, with ``nan`` return NaN, with ``nan_grad`` return a finite output whose gradient is NaN
    (the loss stays finite, the step's update poisons the weights), with ``usr1`` send itself SIGUSR1
    (as SLURM warns) and go on. ``step_seconds`` slows every step down; ``pid_dir``
    records the process id, so that a test can check no worker outlives the launcher. ``attempt``
    (under torchrun, or SLURM's requeue count): misbehave only in that attempt, 0 the first, so that a
    restarted job goes on. ``INTERRUPT_AT_STEP=SIGTERM:3`` in the environment has rank 0 send SIGTERM at that
    step to the command alone (the leader of its process group), as a scheduler does (set for one command
    only: a resume must not repeat it)."""

    def __init__(
        self,
        fail_rank: int = 1,
        fail_step: int = 3,
        kill: bool = False,
        nan: bool = False,
        nan_grad: bool = False,
        usr1: bool = False,
        step_seconds: float = 0.0,
        pid_dir: str = "",
        attempt: int = -1,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.fail_step, self.kill, self.nan, self.usr1 = fail_rank, fail_step, kill, nan, usr1
        self.nan_grad = nan_grad
        self.step_seconds, self.calls = step_seconds, 0
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", 0))
        if attempt >= 0 and int(restarts) != attempt:
            self.fail_rank = -1
        if pid_dir:
            Path(pid_dir, str(os.getpid())).touch()

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.calls += 1
        time.sleep(self.step_seconds)
        rank = dist.get_rank() if dist.is_initialized() else 0
        name, _, at = os.environ.get("INTERRUPT_AT_STEP", ":0").partition(":")
        if rank == 0 and self.calls == int(at):  # the command's process leads the group: a test starts it so
            os.kill(os.getpgrp(), signal.Signals[name])
        if rank == self.fail_rank and self.calls == self.fail_step:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.usr1:
                os.kill(os.getpid(), signal.SIGUSR1)
                return super().forward(x)
            if self.nan:
                return super().forward(x) * float("nan")
            if self.nan_grad:
                out = super().forward(x)
                out.register_hook(lambda grad: grad * float("nan"))
                return out
            raise RuntimeError(f"injected failure at step {self.calls}")
        return super().forward(x)
