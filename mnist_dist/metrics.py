"""Honest numbers: images/s per rank and for the job, synchronised, warm-up left out. Where a step's time goes is
the profiler's to say (``profile=true``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_gather(values: list[float]) -> list[list[float]]:
    """Every rank's few numbers, by rank, on every rank (``[values]`` in one process)."""
    if not dist.is_initialized():
        return [values]
    tensor = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [t.tolist() for t in gathered]


def job_images_per_s(windows: list[tuple[float, float]]) -> float:
    """All the images of every rank's (images, seconds) over the slowest rank's time (the ranks step together)."""
    slowest = max(seconds for _, seconds in windows)
    return sum(images for images, _ in windows) / slowest if slowest else 0.0


class Stopwatch:
    """Seconds between ``start()`` and ``stop()``, summed. The host reads its clock once the work queued on the
    compute stream of each of ``devices`` has finished (dp computes on every GPU of its process): not
    torch.cuda.synchronize(), which would also wait for communication on NCCL's side streams."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cuda = [device for device in devices if device.type == "cuda"]
        self.seconds, self.started = 0.0, None

    def now(self) -> float:
        for device in self.cuda:
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.started = self.now()

    def stop(self) -> None:
        self.seconds, self.started = self.read(), None

    def read(self) -> float:  # the interval running now included
        return self.seconds + (self.now() - self.started if self.started is not None else 0.0)


class Throughput(Stopwatch):
    """Images/s over windows of steps, ``warmup_steps`` left out. ``lap()`` closes a window; ``pause()`` stops
    the clock (evaluation); the next ``step()`` starts it again, counting from the step after."""

    def __init__(self, devices: Sequence[torch.device], warmup_steps: int) -> None:
        super().__init__(devices)
        self.warmup_left, self.images, self.total_images, self.total_seconds = warmup_steps, 0, 0, 0.0

    def step(self, images: int) -> None:
        if self.warmup_left:
            self.warmup_left -= 1
        elif self.started is None:
            self.started = self.now()  # once this step's work has finished: the window counts the next ones
        else:
            self.images += images

    def lap(self) -> tuple[int, float] | None:
        """(images, seconds) since the last lap, or None while warming up or paused."""
        if self.started is None or not self.images:
            return None
        now = self.now()
        window = (self.images, now - self.started)
        self.total_images, self.total_seconds = self.total_images + window[0], self.total_seconds + window[1]
        self.images, self.started = 0, now
        return window

    def pause(self) -> None:
        self.lap()
        self.started = None


class Meters:
    """What a rank measures over a run: training and evaluation time, images/s, and the most parameter, gradient
    and optimizer bytes it held after a step."""

    def __init__(self, devices: Sequence[torch.device], warmup: int) -> None:
        self.train_time, self.eval_time = Stopwatch(devices), Stopwatch(devices)
        self.throughput = Throughput(devices, warmup)
        self.state_bytes = 0


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds, each storage once; in fsdp, the
    local shards. A DDP's gradient buckets are not counted: torch's are not public."""
    parameters = list(model.parameters())
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
