"""Honest numbers: synchronised timing without warm-up, per-rank TensorBoard scalars, global reductions.

Tag names are stable, so runs of every mode overlay in TensorBoard:

- every rank, in ``tb/rank_<r>``: ``train/loss``, ``perf/images_per_s``, and where a step's time
  goes: ``time/data_ms`` (indexing the batch), ``time/forward_backward_ms``, ``time/comm_wait_ms``
  (ddp: time our DDP waits for its all-reduces at the end of backward, i.e. communication not
  hidden behind compute),
  ``time/optimizer_ms``
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


class StepTimer:
    """Splits sampled steps into phases. It synchronises the device at every phase boundary, which
    would slow every step on a GPU, so only the steps passed ``sample=True`` are timed."""

    PHASES = ("data", "forward_backward", "comm_wait", "optimizer")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampling = False
        self.last = 0.0
        self.window = dict.fromkeys(self.PHASES, 0.0)
        self.total = dict.fromkeys(self.PHASES, 0.0)
        self.window_steps = self.total_steps = 0

    def start(self, sample: bool) -> None:
        self.sampling = sample
        if sample:
            synchronize(self.device)
            self.last = time.perf_counter()
            self.window_steps += 1

    def mark(self, phase: str) -> None:
        """Ends ``phase`` of this step (a no-op on steps not sampled)."""
        if self.sampling:
            synchronize(self.device)
            now = time.perf_counter()
            self.window[phase] += now - self.last
            self.last = now

    def lap(self) -> dict[str, float]:
        """Milliseconds per phase, averaged over the sampled steps since the last lap."""
        steps = max(self.window_steps, 1)
        means = {phase: 1000 * seconds / steps for phase, seconds in self.window.items()}
        for phase, seconds in self.window.items():
            self.total[phase] += seconds
        self.total_steps += self.window_steps
        self.window, self.window_steps = dict.fromkeys(self.PHASES, 0.0), 0
        return means

    def means_ms(self) -> dict[str, float]:
        """Milliseconds per phase over the whole run."""
        return {phase: 1000 * seconds / max(self.total_steps, 1) for phase, seconds in self.total.items()}


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
