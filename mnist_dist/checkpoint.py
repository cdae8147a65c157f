"""Writing files so that a crash mid-write never leaves a half file under the final name."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


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
