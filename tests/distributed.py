"""Runs a function on several gloo ranks in fresh processes and collects what each returns."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from mnist_dist.parallel import spawn


def _entry(rank: int, world_size: int, fn, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: no oversubscription
    dist.init_process_group("gloo")  # spawn set the rendezvous address, rank and world size
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(workdir, f"result_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, workdir: Path, *args) -> list:
    """``fn(rank, world_size, *args)`` on each rank; returns the list of results, by rank."""
    spawn(_entry, world_size, fn, str(workdir), args)
    return [torch.load(workdir / f"result_{r}.pt", weights_only=False) for r in range(world_size)]
