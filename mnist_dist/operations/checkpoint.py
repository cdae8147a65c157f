"""Checkpoint files: written atomically (files.py), read back with clear errors, and kept in older copies
for when the newest is unusable.

A checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain Python values only, so
a crafted file cannot run code. Its ``format`` key names the layout (``_ENTRIES``); this version reads
its own, ``FORMAT``, and names any other in a one-line refusal. Whether it may resume this run's config
is compatibility.py's question; what a run puts in it and takes out, resume.py's.
"""

from __future__ import annotations

import errno
import glob
import io
import json
import logging
import math
import os
import pickle
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from mnist_dist.operations import files
from mnist_dist.operations.errors import ConfigError
from mnist_dist.step import first_non_finite

FORMAT = 5  # 5: the optimizer's state keyed by parameter name, in every mode
# What each entry must be; a checkpoint lacking one, or holding something else, is refused by name.
_ENTRIES = {
    "model": dict,
    "optimizer": dict,
    "scheduler": dict,
    "scaler": dict,
    "epoch": int,  # epochs completed
    "epoch_step": int,  # steps done in the next epoch (0 at an epoch's end; checkpoint_every_steps)
    "step": int,
    "rng": list,
    "meters": list,  # by rank: clocks, images and seconds counted, a split log window's losses
    "world_size": int,
    "config": str,
}

_LEAST = {"epoch": 0, "epoch_step": 0, "step": 0, "world_size": 1}  # what a position can be at least
_usable: dict[tuple, bool] = {}  # by file identity (``_identity``): whether ``usable``

log = logging.getLogger("mnist_dist")


def save(obj: Any, path: Path) -> None:
    """torch.save, atomically. Serialised in memory first: a full disk then fails in a plain write,
    as OSError(ENOSPC) naming ``path``, not deep in torch's zip writer."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    files.write(path, buffer.getbuffer())


def save_kept(state: dict, path: Path, keep: int) -> None:
    """``save`` that keeps the ``keep - 1`` previous checkpoints as ``<name>.1.pt`` (newest), ``<name>.2.pt``...
    ``path`` is never missing nor partial: the previous file gets its new name as a hard link (a copy where
    the file system has none) before the new one atomically replaces it. The older ones are for when the
    newest is unusable. Only a checkpoint that could be resumed from (``usable``) takes a kept place: one
    that ``resume=auto`` skipped is dropped, never the one the run went on from."""
    older = [path.with_suffix(f".{n}.pt") for n in range(1, keep)]
    chain = [path, *older]
    kept = [p for p in chain if usable(p)][: keep - 1]
    for stale in older:
        if stale not in kept:
            stale.unlink(missing_ok=True)
    moves = list(zip(kept, older))  # each kept checkpoint to its new place, newest first
    # Before the first gap every kept one moves one place up (done oldest first); after it they move
    # down into the gaps (done newest first), so that no move lands on a checkpoint still to be moved.
    gap = next((i for i, (source, _) in enumerate(moves) if source != chain[i]), len(moves))
    for source, dest in moves[gap:]:
        if source != dest:
            os.replace(source, dest)  # renames within the run directory: the older checkpoints
    for source, dest in reversed(moves[:gap]):
        if source == path:
            _link_or_copy(path, dest)
        else:
            os.replace(source, dest)
    save(state, path)
    _usable[_identity(path)] = True  # what this process wrote is not read back at the next rotation


def _link_or_copy(path: Path, dest: Path) -> None:
    dest.unlink(missing_ok=True)
    try:
        os.link(path, dest)
    except OSError as error:  # EPERM, ENOTSUP, EXDEV...: a file system without hard links (FAT, some FUSE)
        if error.errno not in {errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK}:
            raise
        files.write(dest, path.read_bytes())


def _regular(path: Path) -> bool:
    """A file the run wrote there: a planted link is never rotated into a kept place."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def usable(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of this run directory that resume could go on from (``_read``); read
    once per process (by identity: renames keep it, and what this process saved or read is known)."""
    if not _regular(path):
        return False
    key = _identity(path)
    if key not in _usable:
        try:
            _read(path)
        except _Unusable:
            _usable[key] = False
    return _usable[key]


def _identity(path: Path) -> tuple:
    status = path.stat()
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def save_json(obj: dict, path: Path) -> None:
    """Strict JSON, atomically: a nan or inf is written as null (a bare NaN is refused by strict parsers)."""
    files.write_text(path, (json.dumps(_finite_or_none(obj), indent=2, allow_nan=False) + "\n"))


def save_text(text: str, path: Path) -> None:
    files.write_text(path, text)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


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


class _Unusable(Exception):
    """Why a checkpoint file cannot be resumed from (the message, without the path)."""


def load(path: Path) -> dict:
    """The checkpoint at ``path``, in the current format, or a ConfigError (one line) saying why not and
    naming the older checkpoints kept beside it."""
    try:
        return _read(path)
    except _Unusable as why:
        hint = ""
        if older := kept_older(path):
            names = ", ".join(p.name for p in older)
            hint = f"; older checkpoints there: {names} (resume={older[0]}; resume=auto takes the newest readable one)"
        raise ConfigError(f"resume={path}: {why}{hint}") from None


def _read(path: Path) -> dict:
    try:
        with os.fdopen(files.open_regular(path), "rb") as f:  # a FIFO or a device is refused, never waited on
            try:  # torch.load never checks the zip entries' CRC-32
                with zipfile.ZipFile(f) as archive:
                    damaged = archive.testzip()
            except (zipfile.BadZipFile, EOFError, ValueError) as error:
                raise _Unusable(f"cannot read the checkpoint (not a complete torch.save file: {error})") from None
            if damaged:
                raise _Unusable(f"its bytes are not the ones written (checksum of {damaged} wrong): damaged on disk")
            f.seek(0)
            state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False, i.e. running the file's code
        raise _Unusable(
            "it holds Python objects other than tensors and plain values, which mnist_dist never loads "
            "(not a mnist_dist checkpoint, or a crafted one)"
        ) from None
    except _Unusable:
        raise
    except Exception as error:  # truncated, not a checkpoint, crafted, unreadable: the same to the user
        detail = str(error).splitlines()[0] if str(error) else "no detail"
        raise _Unusable(f"cannot read the checkpoint ({type(error).__name__}: {detail})") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch"} & state.keys():
        raise _Unusable("not a mnist_dist checkpoint (final weights are in model.pt; resume from checkpoint.pt)")
    version = state.pop("format", 1)  # the first layout had no format key
    if version != FORMAT:
        raise _Unusable(
            f"checkpoint format {version!r}, but this version of mnist_dist reads format {FORMAT} only; resume it "
            "with the version that wrote it"
        )
    wrong = [key for key, kind in _ENTRIES.items() if not isinstance(state.get(key), kind)]
    if wrong:
        raise _Unusable(
            f"the checkpoint lacks or has a wrong {', '.join(wrong)} (damaged, or not written by mnist_dist); "
            "resume from another checkpoint.pt"
        )
    out_of_range = [f"{key}={state[key]}" for key, least in _LEAST.items() if state[key] < least]
    if out_of_range or state["epoch_step"] > state["step"]:
        raise _Unusable(
            f"its position is impossible ({', '.join(out_of_range) or 'epoch_step > step'}; damaged, or not "
            "written by mnist_dist); resume from another checkpoint.pt"
        )
    poisoned = first_non_finite(state["model"])  # saved by a version that did not check before saving
    if poisoned:
        raise _Unusable(f"the checkpoint's weights are not finite ({poisoned}): it was saved after training diverged")
    _usable[_identity(path)] = True
    return state


def kept_older(path: Path) -> list[Path]:
    """The older checkpoints ``save_kept`` keeps beside ``path``, newest first: ``checkpoint.1.pt``,
    ``checkpoint.2.pt``, ... for ``checkpoint.pt``; those after it for ``checkpoint.1.pt``."""
    named = re.fullmatch(r"(.*?)(?:\.(\d+))?\.pt", path.name)
    if not named:
        return []
    base, number = named.group(1), int(named.group(2) or 0)
    found = []
    for sibling in path.parent.glob(f"{glob.escape(base)}.*.pt"):
        older = re.fullmatch(rf"{re.escape(base)}\.(\d+)\.pt", sibling.name)
        if older and int(older.group(1)) > number and _regular(sibling):
            found.append((int(older.group(1)), sibling))
    return [sibling for _, sibling in sorted(found)]


def newest_readable(run_dir: Path) -> Path | None:
    """``resume=auto``'s checkpoint: the newest one kept in ``run_dir`` that can be resumed from, saying in
    one line which it skipped; None when there is none, a ConfigError when none can be read. A torchrun
    restart or a SLURM requeue runs the same command again: refusing would fail every attempt alike."""
    newest = run_dir / "checkpoint.pt"
    skipped = []
    for path in ([newest] if newest.exists() or newest.is_symlink() else []) + kept_older(newest):
        try:
            if not _regular(path):  # resumed, it would have the run go on in the link's directory, unlocked
                raise _Unusable("not a file of this run directory (a symbolic link?): resume=auto does not follow it")
            state = _read(path)
        except _Unusable as why:
            skipped.append(f"{path.name} ({why})")
            continue
        if skipped:
            log.warning("resume=auto: skipped %s; resuming from %s (step %d)", "; ".join(skipped), path, state["step"])
        return path
    if skipped:
        raise ConfigError(
            f"resume=auto: no checkpoint in {run_dir} can be read: {'; '.join(skipped)}; move them away to start afresh"
        )
    return None
