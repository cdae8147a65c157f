"""Honest numbers: synchronised timing without warm-up, per-rank TensorBoard scalars, global reductions.

Tag names are stable, so runs of every mode overlay in TensorBoard:

- every rank, in ``tb/rank_<r>``: ``train/loss``, ``perf/images_per_s``, ``perf/comm_wait_ms``
  (ddp: time blocked in ``finish_gradient_sync``, i.e. communication not hidden behind backward)
- rank 0 also: ``train/loss_global`` (mean over ranks), ``perf/images_per_s_global``, ``train/lr``,
  ``perf/epoch_time_s``, ``test/loss``, ``test/accuracy``, ``results/images_per_s`` (the run's
  average, at the end) and the run's hyperparameters for the HPARAMS tab

The x axis is the optimizer step, which means the same global batch in every mode.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


def synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this a clock reads when work was queued, not done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """Reduces a few numbers across ranks (a no-op in one process)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


class Throughput:
    """Images/s over windows of steps, read with the device synchronised and warm-up steps left out.

    ``lap()`` closes a window (at log steps and at the end of an epoch); ``pause()`` stops the clock
    for work that is not training (evaluation, checkpoints); the next ``step()`` starts it again.
    """

    def __init__(self, device: torch.device, warmup_steps: int) -> None:
        self.device = device
        self.warmup_left = warmup_steps
        self.images = 0
        self.started: float | None = None
        self.total_images = 0
        self.total_seconds = 0.0

    def step(self, images: int) -> None:
        if self.warmup_left:
            self.warmup_left -= 1
            return
        if self.started is None:
            # Stamp the start after the previous step's work has finished, not when it was queued.
            synchronize(self.device)
            self.started = time.perf_counter()
            return  # this step began before the clock started; count only steps timed in full
        self.images += images

    def lap(self) -> tuple[int, float] | None:
        """(images, seconds) since the last lap, or None while warming up or paused."""
        if self.started is None or not self.images:
            return None
        synchronize(self.device)
        now = time.perf_counter()
        window = (self.images, now - self.started)
        self.total_images += window[0]
        self.total_seconds += window[1]
        self.images, self.started = 0, now
        return window

    def pause(self) -> None:
        self.lap()
        self.started = None

    @property
    def images_per_s(self) -> float:
        return self.total_images / self.total_seconds if self.total_seconds else 0.0


class Scalars:
    """This rank's TensorBoard directory, ``<run_dir>/tb/rank_<r>``."""

    def __init__(self, run_dir: Path, rank: int, purge_step: int | None = None) -> None:
        self.writer = SummaryWriter(str(run_dir / "tb" / f"rank_{rank}"), purge_step=purge_step)

    def add(self, step: int, **tags: float) -> None:
        """``add(10, **{"train/loss": 0.3})``: one scalar per tag at optimizer step ``step``."""
        for tag, value in tags.items():
            self.writer.add_scalar(tag, value, step)

    def hparams(self, params: dict, metric_tags: list[str]) -> None:
        """Lists this run in TensorBoard's HPARAMS tab: ``params`` against the last value of each tag.

        Written into this directory (SummaryWriter.add_hparams would open a new one), so the metrics
        are the scalars already logged here.
        """
        for summary in hparams(params, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()
