"""Time stamps on the compute stream: the one clock of the project. CUDA events on the compute (current)
stream, which nothing waits for when a stamp is taken, or the host's clock on a CPU."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


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
