"""The check that needs the data: its size against the batch and a resumed position."""

from __future__ import annotations

from pathlib import Path

from mnist_dist.data import split_size, steps_per_epoch
from mnist_dist.operations.errors import ConfigError


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
