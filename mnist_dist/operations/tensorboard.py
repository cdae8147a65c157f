"""The run's TensorBoard directory: written by rank 0 alone, read by the tools and the tests.

One TensorBoard run per training run, ``<run>/tb``: every log window the ranks gather their numbers to
rank 0 (one collective), so a sweep lists one run per mode, a resume continues one event stream, and a
node without a shared disk has nothing of TensorBoard to lose. Tag names are stable, so runs of every
mode overlay; every tag, and what it means: docs/running.md#tensorboard.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from mnist_dist.metrics import job_images_per_s

# CUSTOM SCALARS: {section: {chart title: ["Multiline", [tag regex]]}}. The first section reads the global
# tags, one line per run, i.e. per mode in a sweep; the per-rank charts one line per rank and run.
LAYOUT = {
    "compare runs (global numbers)": {
        "training loss, mean over ranks": ["Multiline", [r"^train/loss_global$"]],
        "images/s, all ranks together": ["Multiline", [r"^perf/images_per_s_global$"]],
        "test accuracy": ["Multiline", [r"^test/accuracy$"]],
        "test accuracy by training ms (evaluation left out)": ["Multiline", [r"^test/accuracy_by_train_ms$"]],
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
TIME_AXIS = {"test/accuracy_by_train_ms"}  # tags whose step is training milliseconds


def tb_dir(run_dir: Path) -> Path:
    return run_dir / "tb"


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar the run logged, ``{tag: {step: value}}`` in step order: the one reader of the tags above
    (compare, bench and the tests read runs through it)."""
    return {tag: {e.step: e.value for e in events} for tag, events in _scalar_events(tb_dir(run_dir)).items()}


def _scalar_events(directory: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: every event, not a sample
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def window_tags(gathered: list[list[float]]) -> dict[str, float]:
    """One log window's tags from every rank's ``[loss, images, seconds]``, by rank: each rank's own, and the
    mean loss and the job's images/s."""
    tags = {}
    for rank, (loss, images, seconds) in enumerate(gathered):
        tags[f"rank_{rank}/train/loss"] = loss
        if seconds:
            tags[f"rank_{rank}/perf/images_per_s"] = images / seconds
    tags["train/loss_global"] = sum(row[0] for row in gathered) / len(gathered)
    rate = job_images_per_s([(row[1], row[2]) for row in gathered])
    if rate:
        tags["perf/images_per_s_global"] = rate
    return tags


class Scalars:
    """The run's TensorBoard directory with the chart layout, opened at the first write (a run that fails before it logs
    leaves none); written on rank 0, a no-op on the others. ``resumed_at``: (step, training milliseconds) of the
    checkpoint a resumed run goes on from; the first write keeps the scalars logged up to there and drops the rest.
    TensorBoard's purge_step cannot: it would cut the time axis's milliseconds by step."""

    def __init__(self, run_dir: Path, rank: int, resumed_at: tuple[int, float] | None = None) -> None:
        self.directory = tb_dir(run_dir)
        self.rank = rank
        self.resumed_at = resumed_at
        self._writer: SummaryWriter | None = None

    @property
    def writer(self) -> SummaryWriter | None:
        if self.rank != 0 or self._writer is not None:
            return self._writer
        # A fresh run drops what an earlier attempt (one that left no checkpoint) logged here: one run, not two merged.
        old = sorted(self.directory.glob("events.out.tfevents.*"))
        kept = _scalar_events(self.directory) if self.resumed_at and old else {}
        with self._naming_the_directory():
            self._writer = SummaryWriter(str(self.directory))
            self._writer.add_custom_scalars(LAYOUT)
            for tag, events in kept.items():
                up_to = self.resumed_at[1] if tag in TIME_AXIS else self.resumed_at[0]
                for event in (event for event in events if event.step <= up_to):
                    self._writer.add_scalar(tag, event.value, event.step, walltime=event.wall_time)
            self._writer.flush()
        for path in old:  # only once the kept history is written: a crash here duplicates, loses nothing
            path.unlink()
        return self._writer

    @contextmanager
    def _naming_the_directory(self) -> Iterator[None]:
        """TensorBoard writes in a thread, and its error (a full disk) comes back at a later call naming no
        file: said as an OSError naming the directory (the thread's traceback goes to the rank log)."""
        try:
            yield
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(self.directory)) from None

    def add(self, step: int, **tags: float) -> None:
        """``add(10, **{"train/loss_global": 0.3})``: one scalar per tag at optimizer step ``step``."""
        if self.writer is None:
            return
        with self._naming_the_directory():
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, step)

    def hparams(self, params: dict, metric_tags: list[str]) -> None:
        """Lists this run in TensorBoard's HPARAMS tab: ``params`` against the last value of each tag logged
        here (SummaryWriter.add_hparams would open a new directory)."""
        if self.writer is None:
            return
        with self._naming_the_directory():
            for summary in hparams(params, {tag: 0.0 for tag in metric_tags}):
                self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with self._naming_the_directory():
                writer.close()
