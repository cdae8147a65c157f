"""Run directories that are never shared: Hydra names them (conf/config.yaml), the live run holds a lock in its own, a
fresh run refuses one that holds another run's results or checkpoint, and under torchrun every node creates rank 0's."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch.distributed as dist
from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback

from mnist_dist.config import ConfigError

LOCK = ".run.lock"  # in the run directory, held for the lifetime of the run that writes there
HYDRA_OWN = {".hydra", "mnist_dist.log"}  # what Hydra writes into a run directory as the job starts (conf/config.yaml)
noted: dict[Path, bool] = {}  # run and sweep directories Hydra was to make: whether they were there (never removed)


class NoteExisting(Callback):
    """Registered in conf/config.yaml: before Hydra creates the run or sweep directory, notes whether it exists."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        noted[Path(config.hydra.run.dir).resolve()] = Path(config.hydra.run.dir).exists()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        noted[Path(config.hydra.sweep.dir).resolve()] = Path(config.hydra.sweep.dir).exists()


def made_for(directory: Path, hydra_own: set[str] = HYDRA_OWN) -> bool:
    """Whether this launch's Hydra created ``directory``: it then holds nothing but Hydra's ``hydra_own``."""
    made = directory.is_dir() and not noted.get(directory.resolve())
    return made and {p.name for p in directory.iterdir()} <= hydra_own | {LOCK}


def remove(directory: Path) -> None:
    """``directory``, and the parents Hydra made for it alone under the working directory (outputs/<date>/)."""
    shutil.rmtree(directory, ignore_errors=True)
    with suppress(ValueError, OSError):  # elsewhere; a parent that is not empty (or a mount point) stays
        os.removedirs(directory.resolve().parent.relative_to(Path.cwd()))


@contextmanager
def owned(run_dir: Path) -> Iterator[bool]:
    """Holds ``run_dir``'s lock (the kernel's: released when its holder dies, however it dies) while the body runs,
    which gets whether this launch's Hydra made ``run_dir``; a ConfigError if a live run holds it."""
    try:
        held = FileLock(run_dir / LOCK, blocking=False, fallback_to_soft=False).acquire()
    except Timeout:
        raise ConfigError(
            f"{run_dir} is in use by another run that is still alive; wait for it, or pass another hydra.run.dir"
        ) from None
    with held:
        yield made_for(run_dir)  # read under the lock: another launch may have made it


def refuse_another_run(run_dir: Path) -> None:
    """A ConfigError if ``run_dir`` holds a run's results or checkpoint, which a fresh run would replace."""
    held = [name for name in ("results.json", "model.pt", "checkpoint.pt") if (run_dir / name).is_file()]
    if held:
        unfinished = "checkpoint.pt" in held and "results.json" not in held
        what, go_on = ("an unfinished", "resume=auto to go on from it, or ") if unfinished else ("a finished", "")
        raise ConfigError(
            f"{run_dir} holds {what} run ({', '.join(held)}), which a fresh run would replace; pass "
            f"{go_on}another hydra.run.dir"
        )


def on_this_node(run_dir: Path) -> Path:
    """Under torchrun (a collective): rank 0's run directory, at its absolute path, created on this node too."""
    shared = [str(run_dir.resolve())]
    dist.broadcast_object_list(shared, src=0)
    Path(shared[0]).mkdir(parents=True, exist_ok=True)
    return Path(shared[0])
