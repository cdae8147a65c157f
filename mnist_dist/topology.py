"""Where a job runs, resolved once: the mode, the device, how many processes and which one this is.

The parent resolves it (``resolve``) before any worker starts and hands each worker its copy
(``for_rank``); under torchrun or srun each process reads the same object from its environment (``from_env``).
``setup_process`` is the one place a process is set up: threads, deterministic kernels, its device and
its process group. In the spirit of torchtitan's ``ParallelDims``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mnist_dist.config import Config, check_batch_divides
from mnist_dist.errors import ConfigError
from mnist_dist.modes import MODES, Processes, devices_needed, world_size


@dataclass(frozen=True)
class Topology:
    mode: str  # the entry of mnist_dist.modes.MODES
    device_type: str  # cuda | cpu
    world_size: int  # worker processes
    batch: int  # this rank's share of the global batch
    gpus: int  # devices a process of an all-GPU mode (dp, split) drives
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1  # worker processes on this machine: they share its CPU cores
    backend: str | None = None  # gloo | nccl for the modes that need a process group

    @property
    def device(self) -> torch.device:
        """This process's device: cuda:<local rank> or cpu."""
        return torch.device(f"cuda:{self.local_rank}" if self.device_type == "cuda" else "cpu")

    def for_rank(self, rank: int) -> Topology:
        """The topology as worker ``rank`` of a job on one machine sees it."""
        return dataclasses.replace(self, rank=rank, local_rank=rank)


def resolve(cfg: Config) -> Topology:
    """The job's topology from its config, in the parent; a ConfigError says what to change."""
    visible = torch.cuda.device_count()
    kind = device_type(cfg.device, devices_needed(cfg), f"gpus={cfg.gpus}", f"use gpus={visible} or device=cpu")
    return _topology(cfg, kind, world_size(cfg), local_world_size=world_size(cfg))


_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST")


def launcher() -> str:
    """Who started this process as one of a job's workers: "torchrun", "srun", or "" (we start them).

    srun counts only with more than one task: a one-task job (or a plain sbatch script) runs as usual.
    """
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # also torchrun inside srun
        return "torchrun"
    if all(key in os.environ for key in _SLURM) and int(os.environ["SLURM_NTASKS"]) > 1:
        return "srun"
    return ""


def launched_rank() -> int:
    """This worker's rank as torchrun or srun set it; 0 where this process starts the workers itself."""
    return int(os.environ.get({"torchrun": "RANK", "srun": "SLURM_PROCID"}.get(launcher(), ""), 0))


def from_env(cfg: Config) -> Topology:
    """This process's topology under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) or srun
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE; SLURM_NODELIST's first node is
    the master): the same worker either way."""
    env, by = os.environ, launcher()
    if by == "srun":
        rank, size, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(size // int(env.get("SLURM_NNODES", "1"))))
        local_size = int(per_node.split("(")[0])  # "2(x3)": 2 tasks on each of 3 nodes
        # What env:// rendezvous reads; every task derives the same port from the job id.
        env.setdefault("MASTER_ADDR", first_node(env["SLURM_NODELIST"]))
        env.setdefault("MASTER_PORT", str(cfg.dist.port or 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    else:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if MODES[cfg.mode.name].processes is not Processes.PER_DEVICE:
        raise ConfigError(
            f"{by} starts {size} processes but mode={cfg.mode.name} runs one; use mode=ddp, torch_ddp or fsdp"
        )
    check_batch_divides(cfg.batch_size, size, cfg.accumulate)
    kind = device_type(cfg.device, local_size, f"{local_size} processes per node", "start fewer, or pass device=cpu")
    topology = _topology(cfg, kind, size, local_size)
    return dataclasses.replace(topology, rank=rank, local_rank=local_rank)


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` where SLURM is installed, else the
    simple forms (``a,b``, ``node[03-05,9]``) read here."""
    if shutil.which("scontrol"):
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if hosts.returncode == 0 and hosts.stdout.split():
            return hosts.stdout.split()[0]
    name, bracket = re.match(r"([^,\[]*)(?:\[([^,\-\]]+))?", nodelist).groups()
    return name + (bracket or "")


def _topology(cfg: Config, device_type: str, size: int, local_world_size: int) -> Topology:
    mode = MODES[cfg.mode.name]
    backend = ("nccl" if device_type == "cuda" else "gloo") if mode.process_group else None
    return Topology(
        cfg.mode.name,
        device_type,
        size,
        cfg.batch_size // size,
        cfg.gpus,
        local_world_size=local_world_size,
        backend=backend,
    )


def device_type(requested: str, needed: int, what: str = "this", fix: str = "pass device=cpu") -> str:
    """``cuda`` or ``cpu``: the one rule for which device a process uses, given ``device=`` (auto, cuda,
    cpu) and the CUDA devices the job drives on this machine; a ConfigError when they are not there."""
    visible = torch.cuda.device_count()
    if requested == "cpu" or (requested == "auto" and visible == 0):
        return "cpu"
    if visible < needed:
        raise ConfigError(
            f"device={requested} needs {needed} CUDA device(s) for {what} but {visible} are visible; {fix}"
            if visible
            else f"device={requested} but no CUDA device is visible; use device=cpu or device=auto"
        )
    return "cuda"


def setup_process(topology: Topology, deterministic: bool, timeout_s: float) -> torch.device:
    """Sets up this process for ``topology``; returns its device. The one place a process is set up."""
    if topology.device_type == "cpu" and topology.local_world_size > 1:
        # N processes on one CPU each default to all cores: oversubscribed threads make every rank slow.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topology.local_world_size))
    deterministic_kernels(deterministic)
    if topology.device_type == "cuda":
        torch.cuda.set_device(topology.device)
    if topology.backend and not dist.is_initialized():
        # The rendezvous address is in the environment: spawn or torchrun put it there.
        dist.init_process_group(
            topology.backend,
            store=_store_of_this_attempt(timedelta(seconds=timeout_s)),
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return topology.device


def deterministic_kernels(on: bool, warn_only: bool = True) -> None:
    """The one place determinism is set. ``warn_only``: an op with no deterministic kernel warns (naming
    itself) instead of stopping the run; the pre-flight check passes False to find such ops."""
    if on:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on


def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    # torchrun's agent serves one TCPStore for all the attempts of a job, and env:// adds no prefix per
    # attempt: after a restart, a worker would read the dead workers' gloo addresses and fail to connect.
    # So each attempt gets its own keys. None: env:// as usual.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mnist_dist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
