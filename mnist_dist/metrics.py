"""Honest numbers: synchronised timing without warm-up, the wrappers' own counters, global reductions.

Every meter reads one clock, the compute stream's (mnist_dist/parallel/timing.py), and stays out of the
step's code; mnist_dist/operations/tensorboard.py logs what they measure.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mnist_dist.parallel import wrappers
from mnist_dist.parallel.timing import StreamClock

# Both DDPs' own counters of their backward passes: torch DDP's logging data (reducer.cpp), and ours under
# the same names (mnist_dist/parallel/timing.py), so that the two are read, logged and compared alike.
DDP_COUNTERS = {
    "backward_compute": "avg_backward_compute_time",
    "backward_comm": "avg_backward_comm_time",
    "backward_overlap": "avg_backward_compute_comm_overlap_time",
}


def ddp_counters_ms(model: torch.nn.Module) -> dict[str, float]:
    """The wrapper's backward compute, communication and their overlap (ms, averaged over the backwards it
    sampled: torch DDP samples some, ours every synchronised one); {} for a model that is neither DDP."""
    data = wrappers.of(model).counters_ns(model)
    return {} if data is None else {name: data.get(key, 0) / 1e6 for name, key in DDP_COUNTERS.items()}


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
    """Splits the steps passed ``sample=True`` into phases, on the clock of ``devices``; on CUDA the stamps are
    read once the step has ended. The trainer ends ``data``; the rest is read from outside the step, so that
    its code knows nothing of timing: optimizer hooks end forward and backward (fp16's unscale included) and
    the optimizer, and our DDP's clock says how much of backward was ``comm_wait`` (docs/running.md)."""

    PHASES = ("data", "forward_backward", "comm_wait", "optimizer")

    def __init__(
        self, devices: Sequence[torch.device], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        self.clock = StreamClock(devices)
        self.wait_clock = wrappers.of(model).clock(model)  # our DistributedDataParallel's (parallel/timing.py)
        self.sampling = False
        self.stamps: list = []  # this step's: the start, then one per phase ended
        self.window = dict.fromkeys(self.PHASES, 0.0)
        self.total = dict.fromkeys(self.PHASES, 0.0)
        self.window_steps = self.total_steps = 0
        optimizer.register_step_pre_hook(lambda *_: self.mark("forward_backward"))
        optimizer.register_step_post_hook(lambda *_: self._optimizer_done())

    def start(self, sample: bool) -> None:
        self.sampling = sample
        if self.wait_clock is not None:  # no events on the steps nobody reads
            self.wait_clock.enabled = sample
        if sample:
            self.stamps = [("start", self.clock.now())]

    def mark(self, phase: str) -> None:
        """Ends ``phase`` of this step (a no-op on steps not sampled)."""
        if self.sampling:
            self.stamps.append((phase, self.clock.now()))

    def _optimizer_done(self) -> None:
        if not self.sampling:
            return
        self.mark("optimizer")
        step = dict.fromkeys(self.PHASES, 0.0)
        for (_, start), (phase, end) in zip(self.stamps, self.stamps[1:]):
            step[phase] += self.clock.seconds(start, end)
        waited = min(self.wait_clock.last_wait_s() if self.wait_clock else 0.0, step["forward_backward"])
        step["forward_backward"] -= waited
        step["comm_wait"] += waited
        for phase, seconds in step.items():
            self.window[phase] += seconds
        self.window_steps += 1
        self.sampling = False

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


class Meters:
    """What a rank measures over a run, on the clock of ``devices``: training and evaluation time (time to
    accuracy counts training only), images/s, the step split, and the most parameter, gradient and optimizer
    bytes it held after a step."""

    def __init__(
        self, devices: Sequence[torch.device], model: torch.nn.Module, optimizer: torch.optim.Optimizer, warmup: int
    ) -> None:
        self.train_time, self.eval_time = Stopwatch(devices), Stopwatch(devices)
        self.throughput = Throughput(devices, warmup)
        self.step_timer = StepTimer(devices, model, optimizer)
        self.state_bytes = 0


def cuda_peak_mib(devices: Sequence[torch.device]) -> dict[str, float] | None:
    """The most memory allocated on each CUDA device in ``devices`` since this run's process setup reset
    it, ``{"cuda:0": MiB, ...}``; None on the CPU. dp gathers outputs on cuda:0, which holds the most."""
    peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**20 for d in devices if d.type == "cuda"}
    return peaks or None


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds, counted from their storages
    (each once); in fsdp, the local shards. Both DDPs' buckets count too: they copy the gradients into
    them (unless .grad is a view of its bucket), so they hold as much again."""
    wrapper, parameters = wrappers.of(model), list(model.parameters())
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {s.data_ptr(): s.nbytes() for s in (wrapper.local(t).untyped_storage() for t in tensors)}
    return sum(storages.values()) + wrapper.bucket_bytes(model)
