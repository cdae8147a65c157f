"""The fast recipe's net, slowed down: for tests that interrupt a run of ``recipe=fast`` mid-way."""

import time

from mnist_dist.model import FastNet


class SlowFastNet(FastNet):
    """FastNet whose training forward first sleeps ``step_seconds``: the same weights, later."""

    def __init__(self, step_seconds: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_seconds = step_seconds

    def forward(self, x):
        if self.training:
            time.sleep(self.step_seconds)
        return super().forward(x)
