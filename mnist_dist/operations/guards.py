"""Checks that need more than the config: the data's size (against the batch and a resumed position), the
machine's cores and memory."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mnist_dist.data import split_size, steps_per_epoch
from mnist_dist.operations import machine
from mnist_dist.operations.errors import ConfigError
from mnist_dist.topology import Topology

log = logging.getLogger("mnist_dist")

# Resident memory of one CPU worker training the convnet on a full-size data set: torch, the data as
# float32 on every rank (60 000 + 10 000 images), the model, optimizer and logs, with a margin over the
# peak_rss_mib that results.json records for a full-size ddp run (docs/performance.md).
CPU_WORKER_BYTES = 1500 * 2**20


def check_data_fits(batch_size: int, world_size: int, raw_dir: Path, resumed: dict | None) -> None:
    """What the training set's size decides, read once: a global batch larger than it would run zero steps
    and save an untrained model; a resumed checkpoint past its epoch's end would skip the rest of the epoch."""
    images = split_size(raw_dir, train=True)
    if batch_size > images:
        raise ConfigError(
            f"batch_size={batch_size} is larger than the training set ({images} images): no step would "
            f"run; use batch_size={images // world_size * world_size} or less"
        )
    steps = steps_per_epoch(images, batch_size)
    if resumed and resumed["epoch_step"] > steps:  # at the end: preempted after the epoch's last step
        raise ConfigError(
            f"resume: the checkpoint is {resumed['epoch_step']} steps into epoch {resumed['epoch'] + 1}, which has "
            f"{steps} steps here ({images} images at batch_size={batch_size}): damaged, crafted, or saved at a "
            "smaller batch_size; resume from another checkpoint.pt"
        )


def check_cpu_capacity(topology: Topology) -> None:
    """CPU workers: refuse when their memory cannot fit, warn when they outnumber the cores."""
    ranks = topology.local_world_size
    if topology.device_type != "cpu" or ranks == 1:
        return
    available = available_memory()
    fits = max(1, available // CPU_WORKER_BYTES)
    if ranks > fits:
        raise ConfigError(
            f"gpus={ranks} CPU workers need about {ranks * CPU_WORKER_BYTES / 2**30:.1f} GiB "
            f"({CPU_WORKER_BYTES // 2**20} MiB each) but {available / 2**30:.1f} GiB is available; "
            f"use gpus={fits} or fewer"
        )
    cores = os.cpu_count() or 1
    if ranks > cores:
        log.warning("gpus=%d CPU workers on %d cores: each rank gets a share of a core and runs slower", ranks, cores)


def available_memory() -> int:
    """Bytes the kernel could give new processes without swapping (MemAvailable)."""
    return machine.meminfo_kib("MemAvailable") * 1024 or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
