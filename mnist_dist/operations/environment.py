"""Who started this process as one of a job's workers (torchrun, srun), and its ranks as the launcher says."""

from __future__ import annotations

import os
import re

# SLURM_STEP_ID: only srun's tasks have it; sbatch exports the others to the batch script itself.
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_STEP_ID")


def launcher() -> str:
    """Who started this process: torchrun, srun (more than one task), or "" (this process starts the workers)."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # also torchrun inside srun
        return "torchrun"
    if all(key in os.environ for key in _SLURM) and int(os.environ["SLURM_NTASKS"]) > 1:
        return "srun"
    return ""


def launched_ranks() -> tuple[int, int, int, int]:
    """rank, world size, local rank and local world size as torchrun or srun set them."""
    env = os.environ
    if launcher() == "srun":
        size = int(env["SLURM_NTASKS"])
        local_size = int(env.get("SLURM_NTASKS_PER_NODE") or size // int(env.get("SLURM_NNODES", "1")))
        return int(env["SLURM_PROCID"]), size, int(env["SLURM_LOCALID"]), local_size
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])


def launched_rank() -> int:
    """This worker's rank as torchrun or srun set it; 0 where this process starts the workers itself."""
    return launched_ranks()[0] if launcher() else 0


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``a`` of ``a,b``, ``node03`` of ``node[03-05,9]``."""
    name, bracket = re.match(r"([^,\[]*)(?:\[([^,\-\]]+))?", nodelist).groups()
    return name + (bracket or "")
