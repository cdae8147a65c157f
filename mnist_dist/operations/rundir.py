"""Run directories that are never shared: unique names, a lock held by the live run, and under torchrun
the same directory created on every node.

Hydra names the default directory by the second (``outputs/<date>/<time>_<mode>``), so two launches
in the same second would write into one directory. ``${unique_dir:...}`` in conf/config.yaml claims
the name with an atomic mkdir and adds ``_2``, ``_3``, ... when another launch has it; a directory
given explicitly (``hydra.run.dir=...``) is protected by the lock instead.
"""

from __future__ import annotations

import fcntl
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from mnist_dist.config import ConfigError

LOCK = ".run.lock"  # in the run directory, held for the lifetime of the run that writes there
_claimed: dict[object, str] = {}  # Hydra resolves the run directory more than once: the same answer each time
_made: set[Path] = set()  # directories this process created for its runs: the only ones it may remove


def _claim(parent: Path, name: str) -> str:
    """``name``, or ``name_<n>`` for the first n >= 2 free in ``parent``, created there (an atomic mkdir: of
    two launches, exactly one creates it)."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = f"{name}_{n}" if n > 1 else name
        with suppress(FileExistsError):
            os.mkdir(parent / candidate)
            break
    _made.add((parent / candidate).resolve())
    return candidate


def unique_dir(base: str) -> str:
    """``base``, or ``base_<n>`` for the first n >= 2 that no other launch has claimed."""
    if base not in _claimed:
        _claimed[base] = str(Path(base).parent / _claim(Path(base).parent, Path(base).name))
    return _claimed[base]


def unique_subdir(sweep_dir: str, name: str, job: int) -> str:
    """A sweep job's directory under ``sweep_dir``: ``name``, or ``name_<n>`` when an earlier job took it
    (jobs that differ only in keys the name leaves out, such as ``data.root``, would share one)."""
    key = (sweep_dir, name, int(job))
    if key not in _claimed:
        _claimed[key] = _claim(Path(sweep_dir), name)
    return _claimed[key]


def note_explicit(argv: list[str]) -> None:
    """Before Hydra runs: a ``hydra.run.dir=`` that does not exist yet is this launch's to make (and to
    remove if the run leaves nothing); one that exists is the user's, never removed."""
    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            path = Path(arg.partition("=")[2].strip("'\""))
            if not path.exists():
                _made.add(path.resolve())


def made_here(run_dir: Path) -> bool:
    """Whether this process created ``run_dir`` for its run (see ``unique_dir`` and ``note_explicit``)."""
    return run_dir.resolve() in _made


OmegaConf.register_new_resolver("unique_dir", unique_dir, replace=True)
OmegaConf.register_new_resolver("unique_subdir", unique_subdir, replace=True)


@contextmanager
def owned(run_dir: Path) -> Iterator[None]:
    """Holds ``run_dir``'s lock while the body runs; a ConfigError if a live run holds it already. An flock:
    the kernel releases it when its holder dies, however it dies. Its file goes when the body ends, removed
    while still held (a launch that opened it just before finds the file it locked gone, and takes a new one)."""
    path = run_dir / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:  # /proc/self, a read-only mount: not a directory a run can write in
            raise ConfigError(
                f"{run_dir} cannot be a run directory: its lock {path} cannot be created ({error.strerror}); pass a "
                "directory the run can write to as hydra.run.dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{run_dir} is in use by another run that is still alive; wait for it, or pass another hydra.run.dir"
            ) from None
        with suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # removed by the run that held it as this launch opened it
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)  # releases the flock


def refuse_another_run(run_dir: Path) -> None:
    """Before a fresh run (no resume) writes anything: a ConfigError if ``run_dir`` holds a run's results or
    checkpoint, which the run would replace (and whose TensorBoard run it would extend)."""
    held = [name for name in ("results.json", "model.pt", "checkpoint.pt") if (run_dir / name).is_file()]
    if "checkpoint.pt" in held and "results.json" not in held:
        raise ConfigError(
            f"{run_dir} holds an unfinished run (checkpoint.pt), which a fresh run would replace; pass resume=auto "
            "to go on from it, or another hydra.run.dir"
        )
    if held:
        raise ConfigError(
            f"{run_dir} holds a finished run ({', '.join(held)}), which a fresh run would replace; pass another "
            "hydra.run.dir"
        )


def on_this_node(run_dir: Path) -> Path:
    """Under torchrun: rank 0's run directory, created on this node too (a collective: every rank calls), so
    that each node needs only its own disk. One under rank 0's working directory (the default ``outputs/...``)
    lands at the same place under this node's; any other at the same absolute path."""
    shared = [str(run_dir), os.getcwd()]
    dist.broadcast_object_list(shared, src=0)
    path, rank0_cwd = Path(shared[0]), Path(shared[1])
    mine = Path.cwd() / path.relative_to(rank0_cwd) if path.is_relative_to(rank0_cwd) else path
    mine.mkdir(parents=True, exist_ok=True)
    return mine
