"""``profile=true``: torch.profiler over a few steps after warm-up, one Chrome trace per rank
(``trace_rank<r>.json`` in the run directory), which opens in Perfetto (ui.perfetto.dev) or chrome://tracing."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

STEPS = 5  # profiled steps: enough to see a step's pattern repeat, small enough to open quickly


def start(run_dir: Path, rank: int, warmup_steps: int, device: torch.device) -> profile:
    """A started profiler that records steps warmup_steps + 2 to warmup_steps + 1 + STEPS (``step()``
    after each training step) and then writes this rank's trace."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(
        activities=activities,
        # wait: the warm-up steps (allocator, first buckets); warmup: one step the profiler discards.
        schedule=schedule(wait=warmup_steps, warmup=1, active=STEPS, repeat=1),
        on_trace_ready=lambda done: done.export_chrome_trace(str(run_dir / f"trace_rank{rank}.json")),
    )
    profiler.start()
    return profiler
