"""A wrapper's own clock for a wait it does, read by whoever reports it (the wrapper's API stays as it is)."""

from __future__ import annotations

import time

import torch


class WaitClock:
    """How long the last ``with clock:`` block took, as the device sees it.

    On CPU the host's clock: the block blocks the host. On CUDA a wait is a stream waiting for another
    (nothing blocks the host), so two events on the current stream bracket it; ``last_s()`` waits for the
    second. Only the last block is kept: nothing grows when nobody reads it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._started = 0.0
        self._last: float | tuple[torch.cuda.Event, torch.cuda.Event] = 0.0

    def __enter__(self) -> WaitClock:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[1].record()
            self._last = self._events
        else:
            self._last = time.perf_counter() - self._started

    def last_s(self) -> float:
        """Seconds the last block took (0 before the first)."""
        if isinstance(self._last, tuple):
            start, end = self._last
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return self._last
