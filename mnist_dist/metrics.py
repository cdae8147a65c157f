"""Honest numbers: synchronised timing without warm-up, and the global reductions that make a job's number.

Every meter reads one clock, the compute stream's (mnist_dist/parallel/timing.py); the training loop starts
and reads them itself, and mnist_dist/operations/tensorboard.py logs what they measure. Where a step's time
goes (forward, backward, communication, optimizer) is the profiler's to say, the same way in every mode:
``profile=true`` (mnist_dist/operations/profiling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mnist_dist.parallel.timing import StreamClock


def _collective_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")


def all_reduce(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """Reduces a few numbers across ranks (a no-op in one process)."""
    if not dist.is_initialized():
        return values
    tensor = _collective_tensor(values)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_gather(values: list[float]) -> list[list[float]]:
    """Every rank's few numbers, by rank, on every rank (``[values]`` in one process)."""
    if not dist.is_initialized():
        return [values]
    tensor = _collective_tensor(values)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [t.tolist() for t in gathered]


def job_images_per_s(windows: list[tuple[float, float]]) -> float:
    """The job's images/s from every rank's (images, seconds): all the images over the slowest rank's time (the
    ranks step together); the one definition of TensorBoard's and results.json's global images/s."""
    slowest = max(seconds for _, seconds in windows)
    return sum(images for images, _ in windows) / slowest if slowest else 0.0


class Throughput:
    """Images/s over windows of steps, on the clock of ``devices`` (every device the process computes on),
    warm-up steps left out. ``lap()`` closes a window; ``pause()`` stops the clock for work that is not
    training (evaluation); the next ``step()`` starts it again."""

    def __init__(self, devices: Sequence[torch.device], warmup_steps: int) -> None:
        self.clock = StreamClock(devices)
        self.warmup_left = warmup_steps
        self.images = 0
        self.started = None  # the window's first stamp
        self.total_images = 0
        self.total_seconds = 0.0

    def step(self, images: int) -> None:
        if self.warmup_left:
            self.warmup_left -= 1
            return
        if self.started is None:
            self.started = self.clock.now()  # on the stream: once the previous step's work has finished
            return  # this step began before the clock started; count only steps timed in full
        self.images += images

    def lap(self) -> tuple[int, float] | None:
        """(images, seconds) since the last lap, or None while warming up or paused."""
        if self.started is None or not self.images:
            return None
        now = self.clock.now()
        window = (self.images, self.clock.seconds(self.started, now))
        self.total_images += window[0]
        self.total_seconds += window[1]
        self.images, self.started = 0, now
        return window

    def pause(self) -> None:
        self.lap()
        self.started = None


class Stopwatch:
    """Seconds spent between ``start()`` and ``stop()``, summed, on the clock of ``devices``."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.clock = StreamClock(devices)
        self.seconds = 0.0
        self.started = None

    def start(self) -> None:
        self.started = self.clock.now()

    def stop(self) -> None:
        self.seconds, self.started = self.read(), None

    def read(self) -> float:
        """Seconds so far, the interval running now included."""
        if self.started is None:
            return self.seconds
        return self.seconds + self.clock.seconds(self.started, self.clock.now())


class Meters:
    """What a rank measures over a run, on the clock of ``devices``: training and evaluation time (time to
    accuracy counts training only), images/s, and the most parameter, gradient and optimizer bytes it held
    after a step."""

    def __init__(self, devices: Sequence[torch.device], warmup: int) -> None:
        self.train_time, self.eval_time = Stopwatch(devices), Stopwatch(devices)
        self.throughput = Throughput(devices, warmup)
        self.state_bytes = 0


def cuda_peak_mib(devices: Sequence[torch.device]) -> dict[str, float] | None:
    """The most memory allocated on each CUDA device in ``devices`` since this run's process setup reset
    it, ``{"cuda:0": MiB, ...}``; None on the CPU. dp gathers outputs on cuda:0, which holds the most."""
    peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**20 for d in devices if d.type == "cuda"}
    return peaks or None


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds, counted from their storages
    (each once); in fsdp, the local shards (a DTensor's ``to_local()``). A DDP's gradient buckets are not
    counted: torch's are not public."""
    parameters = list(model.parameters())
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
