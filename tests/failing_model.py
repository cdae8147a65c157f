"""A convnet that raises on one rank at one training step: for the failure-handling tests."""

import os
from pathlib import Path

import torch.distributed as dist

from mnist_dist.model import ConvNet


class FailingConvNet(ConvNet):
    def __init__(self, fail_rank: int = 1, fail_step: int = 3, pid_dir: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.fail_step, self.calls = fail_rank, fail_step, 0
        if pid_dir:  # lets the test check that no worker outlives the launcher
            Path(pid_dir, str(os.getpid())).touch()

    def forward(self, x):
        if self.training:
            self.calls += 1
            if dist.get_rank() == self.fail_rank and self.calls == self.fail_step:
                raise RuntimeError(f"injected failure at step {self.calls}")
        return super().forward(x)
