"""Where a job runs, as one record: the mode, the device, how many processes and which one this is; from the config
in the parent (``resolve``), from its launcher's variables in a worker (``from_env``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mnist_dist.modes import MODES, world_size
from mnist_dist.operations.errors import ConfigError

if TYPE_CHECKING:
    from mnist_dist.config import Config  # which imports this module: config.validate checks a Topology

# SLURM_STEP_ID: only srun's tasks have it; sbatch exports the others to the batch script itself.
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_STEP_ID")


@dataclass(frozen=True)
class Topology:
    mode: str  # the entry of mnist_dist.modes.MODES
    device_type: str  # cuda | cpu
    world_size: int  # worker processes
    gpus: int  # devices a process of an all-GPU mode (dp, split) drives
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1  # worker processes on this machine: they share its CPU cores
    backend: str | None = None  # gloo | nccl for the modes that need a process group
    # srun --gpus-per-task=1: each task sees only its own GPU, as cuda:0 (SLURM_LOCALID is no device index)
    own_gpu: bool = False

    @property
    def device(self) -> torch.device:
        cuda = f"cuda:{0 if self.own_gpu else self.local_rank}"
        return torch.device(cuda if self.device_type == "cuda" else "cpu")

    @property
    def devices(self) -> list[torch.device]:
        """The devices this process computes on (dp and split: ``gpus`` of them): those it synchronises and measures."""
        mode = MODES[self.mode]
        if self.device_type == "cuda" and mode.all_gpus:
            return [torch.device(f"cuda:{i}") for i in range(mode.devices(self.gpus))]
        return [self.device]


def resolve(cfg: Config) -> Topology:
    """The job's topology from its config, in the parent; a ConfigError says what to change."""
    needed, visible = MODES[cfg.mode.name].devices(cfg.gpus), torch.cuda.device_count()
    kind = device_type(cfg.device, needed, f"gpus={cfg.gpus}", f"use gpus={visible} or device=cpu")
    return _topology(cfg, kind, world_size(cfg), local_world_size=world_size(cfg))


def launcher() -> str:
    """Who started this process: torchrun, srun (more than one task), or "" (this process starts the workers)."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # also torchrun inside srun
        return "torchrun"
    if all(key in os.environ for key in _SLURM) and int(os.environ["SLURM_NTASKS"]) > 1:
        return "srun"
    return ""


def launched_rank() -> int:
    """This worker's rank as torchrun or srun set it; 0 where this process starts the workers itself."""
    by = launcher()
    return int(os.environ["SLURM_PROCID" if by == "srun" else "RANK"]) if by else 0


def from_env(cfg: Config) -> Topology:
    """This process's topology from torchrun's variables (which spawn sets too) or srun's."""
    env, by = os.environ, launcher()
    if by == "srun":
        rank, size, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
        local_size = int(env.get("SLURM_NTASKS_PER_NODE") or size // int(env.get("SLURM_NNODES", "1")))
        # env://: rank 0 serves the store where the batch script says, else on the first node of the list
        # (``a`` of ``a,b``, ``node03`` of ``node[03-05,9]``), at torchrun's default port.
        node, bracket = re.match(r"([^,\[]*)(?:\[([^,\-\]]+))?", env["SLURM_NODELIST"]).groups()
        env.setdefault("MASTER_ADDR", node + (bracket or ""))
        env.setdefault("MASTER_PORT", "29500")
    else:
        rank, size, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        local_size = int(env["LOCAL_WORLD_SIZE"])
    own_gpu = by == "srun" and local_size > 1 and torch.cuda.device_count() == 1  # each task sees one GPU
    needed = 1 if own_gpu else local_size
    kind = device_type(cfg.device, needed, f"{local_size} processes per node", "start fewer, or pass device=cpu")
    return _topology(cfg, kind, size, rank=rank, local_rank=local_rank, local_world_size=local_size, own_gpu=own_gpu)


def _topology(cfg: Config, kind: str, size: int, **where: int | bool) -> Topology:
    backend = ("nccl" if kind == "cuda" else "gloo") if MODES[cfg.mode.name].per_device else None
    return Topology(cfg.mode.name, kind, size, cfg.gpus, backend=backend, **where)


def device_type(requested: str, needed: int, what: str = "this", fix: str = "pass device=cpu") -> str:
    """``cuda`` or ``cpu`` for ``device=`` when the job drives ``needed`` CUDA devices here; a ConfigError if absent."""
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


def setup_process(topology: Topology, deterministic: bool, timeout_s: float, tf32: bool = False) -> None:
    if topology.device_type == "cpu" and topology.local_world_size > 1:
        # N processes on one CPU each default to all cores: oversubscribed threads make every rank slow.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topology.local_world_size))
    deterministic_kernels(deterministic)
    # fp32 convolutions (cuDNN) and matmuls (cuBLAS) in TF32, or in full fp32 ("ieee"); the legacy flags too: torch's
    # code (inductor) still reads them, and that raises where they disagree. No effect on a CPU.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    precision = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = torch.backends.cuda.matmul.fp32_precision = precision
    if topology.device_type == "cuda":
        torch.cuda.set_device(topology.device)
    if topology.backend and not dist.is_initialized():
        # device_id binds NCCL to this GPU and creates its communicator now, so a broken NCCL fails here (and
        # barrier() knows the device instead of warning at every call).
        dist.init_process_group(
            topology.backend,
            init_method=os.environ.get("MNIST_DIST_INIT_METHOD"),  # spawn's store file; else env:// or torchrun's
            store=_store_of_this_attempt(timedelta(seconds=timeout_s)),
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=timeout_s),
            **({"device_id": topology.device} if topology.backend == "nccl" else {}),
        )


def deterministic_kernels(on: bool, warn_only: bool = True) -> None:
    """``warn_only``: an op with no deterministic kernel warns, naming itself, instead of stopping the run."""
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = not on


def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    """torchrun's store under a prefix of this attempt's (None elsewhere): the agent serves one for all attempts and
    env:// adds no prefix, so a restarted worker would read the dead workers' gloo addresses and fail to connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mnist_dist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
