"""Time stamps on the compute stream, and our DDP's backward counters built from them.

``StreamClock`` is the one clock of the project: CUDA events on the compute (current) stream, which nothing
waits for when a stamp is taken, or the host's clock on a CPU. torch DDP's reducer times with the same.

``BackwardClock`` (our DistributedDataParallel's ``model.clock``, attached by the app) stamps what torch DDP's
reducer.cpp stamps in a sampled iteration: backward compute start (the end of forward), comm start (the
first bucket's all-reduce), compute end (every gradient ready), comm end (every bucket reduced), in every
synchronised backward while ``enabled`` (the trainer enables it on the steps it samples); it averages them
into torch's three counters (compute, comm, compute end - comm start: the overlap), and keeps the last
backward's comm end - compute end: the wait that backward did not hide.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

MARKS = ("compute_start", "comm_start", "compute_end", "comm_end")
_AVERAGES = ("avg_backward_compute_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")
_KEPT = 100  # backwards not yet read: CUDA events waiting to be; the oldest go first


class StreamClock:
    """Stamps on the compute stream of the first of ``devices``, after the work queued so far on the others'
    (dp computes on every GPU of its process): a device-side wait, so taking a stamp never blocks the host."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.first, *self.others = devices

    def now(self) -> float | torch.cuda.Event:
        if self.first.type != "cuda":
            return time.perf_counter()
        for other in self.others:
            torch.cuda.current_stream(self.first).wait_stream(torch.cuda.current_stream(other))
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream of the current device (the first): each rank set its own
        return event

    def seconds(self, start, end) -> float:
        """Seconds from stamp ``start`` to the later ``end``; on CUDA it waits for ``end`` to be reached."""
        if self.first.type != "cuda":
            return end - start
        # The end's event, not torch.cuda.synchronize(): that also waits for the side streams (NCCL's, our
        # DDP's), i.e. for communication the compute stream never waited for.
        end.synchronize()
        return start.elapsed_time(end) / 1000


class BackwardClock:
    def __init__(self, device: torch.device) -> None:
        self.clock = StreamClock([device])
        self.enabled = True
        self._current: dict = {}
        self._pending: list[dict] = []  # complete backwards, not yet added up
        self._sums = dict.fromkeys(_AVERAGES, 0.0)
        self._count = 0
        self._last_wait = 0.0

    def mark(self, name: str) -> None:
        """Stamps ``name`` (one of MARKS) of the backward in progress; the first stamp of a name counts."""
        if not self.enabled:
            return
        if name == "compute_start":
            self._current = {}
        if name in self._current:
            return
        self._current[name] = self.clock.now()
        if name == "comm_end" and len(self._current) == len(MARKS):
            self._pending = [*self._pending[-_KEPT + 1 :], self._current]
            self._current = {}

    def _add_up(self) -> None:
        seconds = self.clock.seconds
        for stamps in self._pending:
            compute = seconds(stamps["compute_start"], stamps["compute_end"])
            comm = seconds(stamps["comm_start"], stamps["comm_end"])
            hidden = max(0.0, seconds(stamps["comm_start"], stamps["compute_end"]))
            for name, value in zip(_AVERAGES, (compute, comm, min(hidden, comm))):
                self._sums[name] += value
            self._count += 1
            self._last_wait = max(0.0, seconds(stamps["compute_end"], stamps["comm_end"]))
        self._pending = []

    def last_wait_s(self) -> float:
        """Seconds the last synchronised backward waited for its all-reduces after its compute ended."""
        self._add_up()
        return self._last_wait

    def averages_ns(self) -> dict[str, int]:
        """torch DDP's three averages, in its units (ns), over every stamped backward so far."""
        self._add_up()
        return {name: int(1e9 * seconds / max(self._count, 1)) for name, seconds in self._sums.items()}
