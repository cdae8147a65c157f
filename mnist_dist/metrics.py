"""Honest numbers: synchronised timing without warm-up, per-rank TensorBoard scalars, global reductions.

Tag names are stable, so runs of every mode overlay in TensorBoard. Rank 0 writes ``<run>/tb``, the
one TensorBoard run per training run that comparisons need; rank r > 0 writes ``<run>/tb/rank_<r>``,
which only the per-rank charts show (and which the run filter ``tb$`` hides):

- every rank: ``train/loss``, ``perf/images_per_s``, and where a step's time goes:
  ``time/data_ms`` (indexing the batch), ``time/forward_backward_ms``, ``time/comm_wait_ms``
  (ddp: time our DDP waits for its all-reduces at the end of backward, i.e. communication not
  hidden behind compute),
  ``time/optimizer_ms``
- rank 0 also: ``train/loss_global`` (mean over ranks), ``perf/images_per_s_global``, ``train/lr``,
  ``perf/epoch_time_s``, ``test/loss``, ``test/accuracy`` (at every evaluation: epoch ends, and every
  ``eval_every_steps``), ``test/accuracy_by_train_ms`` (the same accuracies with training milliseconds,
  evaluation left out, as the x axis: modes compare by time), ``results/images_per_s`` (the run's
  average, at the end), the run's hyperparameters for the HPARAMS tab, and ``LAYOUT`` for the
  CUSTOM SCALARS tab: the comparison charts first, per-rank details in a folded section.

The x axis is the optimizer step, which means the same global batch in every mode.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

# CUSTOM SCALARS: (section, open by default, [(chart title, tag regex), ...]). Only rank 0 writes the
# global tags, so the open charts hold one line per run, i.e. per mode in a sweep.
LAYOUT = [
    (
        "compare runs (rank 0: global numbers)",
        True,
        [
            ("training loss, mean over ranks", r"^train/loss_global$"),
            ("images/s, all ranks together", r"^perf/images_per_s_global$"),
            ("test accuracy", r"^test/accuracy$"),
            ("test accuracy against training time (x: ms, evaluation left out)", r"^test/accuracy_by_train_ms$"),
            ("test loss", r"^test/loss$"),
        ],
    ),
    (
        "per rank (every rank of every run)",
        False,
        [
            ("training loss on this rank's share", r"^train/loss$"),
            ("images/s of this rank", r"^perf/images_per_s$"),
            ("where a sampled step's time goes (ms)", r"^time/"),
        ],
    ),
    ("schedule", False, [("learning rate", r"^train/lr$"), ("epoch time (s)", r"^perf/epoch_time_s$")]),
]


def tb_dir(run_dir: Path, rank: int) -> Path:
    """Rank 0's TensorBoard run is ``<run>/tb``; other ranks nest below it, out of the comparison."""
    return run_dir / "tb" if rank == 0 else run_dir / "tb" / f"rank_{rank}"


def custom_scalars_summary() -> Summary:
    """``LAYOUT`` as the summary the CUSTOM SCALARS tab reads. torch's ``add_custom_scalars`` cannot
    fold a section (``closed``), and TensorBoard's own ``custom_scalar.summary`` needs TensorFlow."""
    layout = layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title=title,
                closed=not open_,
                chart=[
                    layout_pb2.Chart(title=chart, multiline=layout_pb2.MultilineChartContent(tag=[regex]))
                    for chart, regex in charts
                ],
            )
            for title, open_, charts in LAYOUT
        ]
    )
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    return Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor, metadata=metadata)])


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


class Stopwatch:
    """Seconds spent between ``start()`` and ``stop()``, summed; the device is synchronised at both ends.

    Time to accuracy counts training only: the trainer stops its training stopwatch while it evaluates.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self.started: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self.started = time.perf_counter()

    def stop(self) -> None:
        if self.started is not None:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self.started
            self.started = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not counting inside the block; counting again after it if it was counting before."""
        running = self.started is not None
        self.stop()
        try:
            yield
        finally:
            if running:
                self.start()


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
    """This rank's TensorBoard directory, ``tb_dir(run_dir, rank)``; rank 0 adds the chart layout."""

    def __init__(self, run_dir: Path, rank: int, purge_step: int | None = None) -> None:
        self.writer = SummaryWriter(str(tb_dir(run_dir, rank)), purge_step=purge_step)
        if rank == 0:
            self.writer.file_writer.add_summary(custom_scalars_summary())

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


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds, counted from their storages
    (each once: our DDP's gradients are views of its buckets); in fsdp, the local shards."""
    parameters = list(model.parameters())
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        # A DTensor (fsdp) holds its shard locally; isinstance would mean importing DTensor in every mode.
        storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
