"""What an srun task needs beyond its environment's variables (environment.py reads those): whether
it has a GPU of its own, and the store its job step meets in. mnist_dist/topology.py calls both."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from mnist_dist.operations.environment import slurm_job
from mnist_dist.operations.errors import ConfigError


def gpu_of_its_own(tasks: int) -> bool:
    """Whether this srun task, one of ``tasks`` on its node that each see one GPU, has one of its own
    (``--gpus-per-task=1``, or ``--gpu-bind=single:1`` over the SLURM_STEP_GPUS), or a ConfigError: NCCL,
    one rank per GPU, would fail later with "Duplicate GPU detected" (``--gres=gpu:1``)."""
    env = os.environ
    step_gpus = [gpu for gpu in env.get("SLURM_STEP_GPUS", env.get("SLURM_JOB_GPUS", "")).split(",") if gpu]
    if env.get("SLURM_GPUS_PER_TASK") or len(step_gpus) >= tasks:
        return True
    raise ConfigError(
        f"{tasks} srun tasks on this node share the one GPU each sees (CUDA_VISIBLE_DEVICES="
        f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}, no SLURM_GPUS_PER_TASK): NCCL takes one rank per GPU; ask srun "
        "for --gpus-per-task=1, start one task per GPU, or pass device=cpu"
    )


def rendezvous_store(timeout: timedelta) -> dist.Store:
    """Rank 0 serves the store and writes whose it is; a task that finds another job step's there (two steps
    derived one port) fails at once, and the step's keys are under its own prefix, so none is shared."""
    env, job = os.environ, slurm_job()
    host, port, rank = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["SLURM_PROCID"])
    try:
        store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistNetworkError as error:
        raise ConfigError(
            f"cannot serve the rendezvous store at {host}:{port} ({str(error).splitlines()[0]}): another job uses "
            "the port? pass dist.port=<a free port>"
        ) from None
    if rank == 0:
        store.set("mnist_dist/slurm_job", job)
    elif (owner := store.get("mnist_dist/slurm_job").decode()) != job:
        raise ConfigError(
            f"the rendezvous store at {host}:{port} belongs to SLURM job {owner}, not to this job {job}: both derived "
            "the same port; pass dist.port=<a free port> to one of them"
        )
    return dist.PrefixStore(f"mnist_dist/slurm_{job}", store)
