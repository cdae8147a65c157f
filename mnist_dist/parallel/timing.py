"""Our DDP's own clock for its backward passes: the counters torch DDP's reducer keeps, on the same marks.

torch DDP (reducer.cpp, ``_get_ddp_logging_data()``) stamps, in each sampled iteration: backward compute
start (the end of forward), communication start (the first bucket's all-reduce), backward compute end
(every gradient ready) and communication end (every bucket reduced), and reports in nanoseconds

- ``avg_backward_compute_time``: compute end - compute start;
- ``avg_backward_comm_time``: comm end - comm start;
- ``avg_backward_compute_comm_overlap_time``: compute end - comm start, the communication backward hid.

This clock stamps the same four moments of every synchronised backward and averages them the same way,
so the two wrappers' numbers sit side by side. On CPU the stamps are the host's clock (the host is the
compute stream); on CUDA events on the current stream, read only when asked. Of the last backward it
also keeps comm end - compute end: the wait that backward did not hide.
"""

from __future__ import annotations

import time

import torch

MARKS = ("compute_start", "comm_start", "compute_end", "comm_end")
_KEPT = 100  # backwards not yet read: CUDA events waiting to be; the oldest go first


class BackwardClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._current: dict[str, float | torch.cuda.Event] = {}
        self._pending: list[dict] = []  # complete backwards, not yet added up
        self._sums = dict.fromkeys(("compute", "comm", "overlap"), 0.0)
        self._count = 0
        self._last_wait = 0.0

    def mark(self, name: str) -> None:
        """Stamps ``name`` (one of MARKS) of the backward in progress; the first stamp of a name counts."""
        if name == "compute_start":
            self._current = {}
        if name in self._current:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._current[name] = event
        else:
            self._current[name] = time.perf_counter()
        if name == "comm_end" and len(self._current) == len(MARKS):
            self._pending = [*self._pending[-_KEPT + 1 :], self._current]
            self._current = {}

    def _seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def _add_up(self) -> None:
        for stamps in self._pending:
            compute = self._seconds(stamps["compute_start"], stamps["compute_end"])
            comm = self._seconds(stamps["comm_start"], stamps["comm_end"])
            hidden = max(0.0, self._seconds(stamps["comm_start"], stamps["compute_end"]))
            self._sums["compute"] += compute
            self._sums["comm"] += comm
            self._sums["overlap"] += min(hidden, comm)
            self._count += 1
            self._last_wait = max(0.0, self._seconds(stamps["compute_end"], stamps["comm_end"]))
        self._pending = []

    def last_wait_s(self) -> float:
        """Seconds the last synchronised backward waited for its all-reduces after its compute ended."""
        self._add_up()
        return self._last_wait

    def averages_ns(self) -> dict[str, int]:
        """torch DDP's three averages, in its units (ns), over every synchronised backward so far."""
        self._add_up()
        count = max(self._count, 1)
        return {
            "avg_backward_compute_time": int(1e9 * self._sums["compute"] / count),
            "avg_backward_comm_time": int(1e9 * self._sums["comm"] / count),
            "avg_backward_compute_comm_overlap_time": int(1e9 * self._sums["overlap"] / count),
        }
