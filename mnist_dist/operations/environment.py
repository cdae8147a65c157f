"""Who started this process as one of a job's workers (torchrun, srun), and its ranks and sizes, read from
the launcher's variables and checked; mnist_dist/topology.py builds the job's topology from them."""

from __future__ import annotations

import hashlib
import os
import re

from mnist_dist.operations.errors import ConfigError

# SLURM_STEP_ID: only srun's tasks have it; sbatch exports the others to the batch script itself.
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_STEP_ID")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Derived ports lie below Linux's ephemeral range (32768-60999): no outgoing connection holds one.
_SLURM_PORTS = range(15000, 32768)


def launcher() -> str:
    """Who started the workers: "torchrun", "srun", or "" (this process does). srun counts only with more than
    one task, and an sbatch script's batch step (no SLURM_STEP_ID) starts its workers itself."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # also torchrun inside srun
        return "torchrun"
    if all(key in os.environ for key in _SLURM) and _whole("SLURM_NTASKS") > 1:
        return "srun"
    return ""


def _whole(name: str) -> int:
    """The launcher's variable ``name`` as a number, or a ConfigError naming it (RANK=abc)."""
    value = os.environ[name]
    if not value.strip().isdigit():
        raise ConfigError(
            f"{name}={value!r} is not a whole number: a launcher (torchrun, srun) sets it; unset it to have mnist_dist "
            "start its workers, or start it with the launcher"
        )
    return int(value)


def launched_ranks() -> tuple[int, int, int, int]:
    """rank, world size, local rank and local world size as torchrun or srun set them, checked: a rank beyond
    the world size (RANK=5 WORLD_SIZE=2) would wait for peers that never come, writing rank_5.log meanwhile."""
    env = os.environ
    if launcher() == "srun":
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
        rank, size, local_rank = (_whole(name) for name in names[:3])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(size // max(1, int(env.get("SLURM_NNODES", "1")))))
        local_size = int(per_node.split("(")[0]) if per_node.split("(")[0].isdigit() else 0  # "2(x3)": 2 on each of 3
    else:
        missing = [key for key in _TORCHRUN if key not in env]
        if missing:
            raise ConfigError(
                f"LOCAL_RANK and WORLD_SIZE are set, but not {', '.join(missing)}: left over from another job? "
                "unset them to have mnist_dist start its workers, or start it with torchrun"
            )
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        rank, size, local_rank, local_size = (_whole(name) for name in names)
    for index, count, index_name, count_name in ((rank, size, *names[0:2]), (local_rank, local_size, *names[2:4])):
        if not index < count:
            raise ConfigError(
                f"{index_name}={index} with {count_name}={count}: ranks run from 0 to {count_name} - 1; "
                "start the job with its launcher, which sets them together"
            )
    return rank, size, local_rank, local_size


def slurm_port() -> int:
    """The port every task of this job step derives alike, and no other step (hashed): "<job id>.<step id>"."""
    step = f"{os.environ.get('SLURM_JOB_ID', '0')}.{os.environ['SLURM_STEP_ID']}"
    digest = hashlib.sha256(step.encode()).digest()
    return _SLURM_PORTS[int.from_bytes(digest[:4], "big") % len(_SLURM_PORTS)]


def launched_rank() -> int:
    """This worker's rank as torchrun or srun set it; 0 where this process starts the workers itself."""
    return launched_ranks()[0] if launcher() else 0


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``a`` of ``a,b``, ``node03`` of ``node[03-05,9]``."""
    name, bracket = re.match(r"([^,\[]*)(?:\[([^,\-\]]+))?", nodelist).groups()
    return name + (bracket or "")
