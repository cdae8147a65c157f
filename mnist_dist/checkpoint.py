"""Checkpoints: written so that a crash mid-write never leaves a half file under the final name,
read back with clear errors, and holding every rank's random state so that a resumed run continues
exactly where the interrupted one stopped."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mnist_dist.config import Config, ConfigError, world_size


def _atomic_write(path: Path, write) -> None:
    # Write beside the target, then rename: os.replace is atomic on POSIX, so readers see either
    # the old file or the new one, never a truncated mix.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save(obj: Any, path: Path) -> None:
    """torch.save, atomically."""
    _atomic_write(path, lambda handle: torch.save(obj, handle))


def save_json(obj: dict, path: Path) -> None:
    _atomic_write(path, lambda handle: handle.write((json.dumps(obj, indent=2) + "\n").encode()))


def locate(resume: str) -> Path:
    """The checkpoint named by ``resume=``: a checkpoint file, or a run directory holding one."""
    path = Path(resume).expanduser().resolve()
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise ConfigError(
            f"resume={resume}: no checkpoint there; pass a run directory that holds checkpoint.pt, or the file itself"
        )
    return path


def load(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated, not a checkpoint, unreadable: all mean the same to the user
        raise ConfigError(
            f"resume={path}: cannot read the checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'})"
        ) from None
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch", "rng"} <= state.keys():
        raise ConfigError(
            f"resume={path}: not a mnist_dist checkpoint (final weights are in model.pt; resume from checkpoint.pt)"
        )
    return state


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses to continue a run with a different model, global batch or world size, unless told to."""
    saved = OmegaConf.create(state["config"])
    changes = [
        f"{key} {before} -> {after}"
        for key, before, after in (
            ("model", OmegaConf.to_container(saved.model), cfg.model),
            ("batch_size", saved.batch_size, cfg.batch_size),
            ("world_size", state["world_size"], world_size(cfg)),
            ("data", saved.data.name, cfg.data.name),
        )
        if before != after
    ]
    if changes and not cfg.resume_allow_changes:
        raise ConfigError(
            f"resume: the checkpoint was trained with other settings ({'; '.join(changes)}); "
            "use the same settings, or resume_allow_changes=true if that is intended"
        )
    if state["epoch"] >= cfg.epochs:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {cfg.epochs}; "
            f"pass epochs={state['epoch'] + 1} or more to train further"
        )


def rng_states_of_all_ranks() -> list[dict]:
    """Every rank's generators (Python, torch CPU, CUDA), by rank: dropout continues as if never stopped."""
    mine = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }
    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def restore_rng(states: list[dict], rank: int) -> None:
    if rank >= len(states):  # resumed on more ranks (resume_allow_changes): new ranks keep their seed
        return
    random.setstate(states[rank]["python"])
    torch.set_rng_state(states[rank]["torch"])
    if states[rank]["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states[rank]["cuda"])
