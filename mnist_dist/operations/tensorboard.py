"""One TensorBoard run per training run, ``<run>/tb``, written by rank 0 alone (the ranks gather their numbers to it),
so a sweep lists one run per mode and a resume continues one event stream. Every tag: docs/running.md#tensorboard."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from mnist_dist.metrics import job_images_per_s

# CUSTOM SCALARS: {section: {chart title: ["Multiline", [tag regex]]}}: the global tags one line per run (per
# mode in a sweep), the per-rank ones one line per rank and run.
LAYOUT = {
    "compare runs (global numbers)": {
        "training loss, mean over ranks": ["Multiline", [r"^train/loss_global$"]],
        "images/s, all ranks together": ["Multiline", [r"^perf/images_per_s_global$"]],
        "test accuracy": ["Multiline", [r"^test/accuracy$"]],
        "test loss": ["Multiline", [r"^test/loss$"]],
    },
    "per rank (every rank of every run)": {
        "training loss on each rank's share": ["Multiline", [r"^rank_\d+/train/loss$"]],
        "images/s of each rank": ["Multiline", [r"^rank_\d+/perf/images_per_s$"]],
    },
    "schedule": {
        "learning rate": ["Multiline", [r"^train/lr$"]],
        "epoch time (s)": ["Multiline", [r"^perf/epoch_time_s$"]],
    },
}


def window_tags(gathered: list[list[float]]) -> dict[str, float]:
    """A log window's tags from each rank's ``[loss, images, seconds]``: per rank, the mean loss, the job's images/s."""
    tags = {}
    for rank, (loss, images, seconds) in enumerate(gathered):
        tags[f"rank_{rank}/train/loss"] = loss
        if seconds:
            tags[f"rank_{rank}/perf/images_per_s"] = images / seconds
    tags["train/loss_global"] = sum(row[0] for row in gathered) / len(gathered)
    if rate := job_images_per_s([(row[1], row[2]) for row in gathered]):
        tags["perf/images_per_s_global"] = rate
    return tags


class Scalars:
    """The run's TensorBoard directory with the chart layout, opened by rank 0's first write (a run that fails before it
    logs leaves none). What an earlier attempt logged after ``resumed_step`` (fresh: anything) is purged: one run."""

    def __init__(self, run_dir: Path, rank: int, resumed_step: int | None = None) -> None:
        self.directory, self.rank = run_dir / "tb", rank
        self.purge_step = 0 if resumed_step is None else resumed_step + 1
        self.writer: SummaryWriter | None = None

    def add(self, step: int, **tags: float) -> None:
        if self.rank == 0 and self.writer is None:
            self.writer = SummaryWriter(str(self.directory), purge_step=self.purge_step)
            self.writer.add_custom_scalars(LAYOUT)
        if self.writer is not None:
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, step)

    def hparams(self, params: dict, metric_tags: list[str]) -> None:
        """Lists this run in TensorBoard's HPARAMS tab: ``params`` against the last value of each tag logged
        here (SummaryWriter.add_hparams would open a new directory)."""
        if self.writer is not None:
            for summary in hparams(params, {tag: 0.0 for tag in metric_tags}):
                self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
