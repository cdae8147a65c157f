"""What several test modules share: configs on tiny data, TensorBoard scalars, ranks in fresh processes,
the machine fields.

Tests import these from here (``from helpers import ...``), never from each other or from conftest.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mnist_dist.metrics import tb_dir
from mnist_dist.parallel import spawn

FASHION = Path("/usr/share/datasets/fashion-mnist")


def compose_config(data_root: Path, *overrides: str):
    """The Config the CLI would run with these overrides, on the data in ``data_root``, no bar."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"data.root={data_root}", "data.mirrors=[]", "progress=false", *overrides])
    return OmegaConf.to_object(cfg)


def events(run_dir: Path, rank: int) -> EventAccumulator:
    accumulator = EventAccumulator(str(tb_dir(run_dir, rank)))
    accumulator.Reload()
    return accumulator


def scalars(run_dir: Path, rank: int) -> dict[str, list[float]]:
    """Every scalar tag rank ``rank`` wrote to TensorBoard, with its values in step order."""
    tb = events(run_dir, rank)
    return {tag: [e.value for e in tb.Scalars(tag)] for tag in tb.Tags()["scalars"]}


def _entry(rank: int, world_size: int, fn, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: no oversubscription
    dist.init_process_group("gloo")  # spawn set the rendezvous address, rank and world size
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(workdir, f"result_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, workdir: Path, *args) -> list:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` gloo ranks in fresh processes; returns
    what each returned, by rank."""
    spawn(_entry, world_size, fn, str(workdir), args)
    return [torch.load(workdir / f"result_{r}.pt", weights_only=False) for r in range(world_size)]


MACHINE_FIELDS = ("cpu", "cpu_capability", "cores", "torch_threads", "memory_gib", "torch", "gpus")


def assert_machine_fields(info: dict) -> None:
    """``info`` is mnist_dist.machine.describe(): every field present and non-empty."""
    for field in MACHINE_FIELDS:
        assert info[field] not in ("", None), field
    assert isinstance(info["cpu_flags"], list)
    if info["gpus"]:
        assert info["gpu"] and info["cuda"] and info["driver"]
