"""The atomic write that every file written whole goes through: a temp file beside the target, fsync, os.replace."""

from __future__ import annotations

import os
from pathlib import Path


def write(target: Path, data: bytes | memoryview, previous: Path | None = None) -> None:
    """``data`` as ``target``: a crash or a signal at any moment leaves the old file or the new one, whole (given
    ``previous``, the old one is moved there first). An OSError names ``target``, not the temp file."""
    # One name: a write killed by SIGKILL leaves it to the next. One writer per target (the run directory's and the
    # data's locks): two at once would share it.
    temp = target.with_name(f".{target.name}.tmp")
    try:
        with open(temp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if previous and target.exists():
            os.replace(target, previous)
        os.replace(temp, target)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(target)) from None
        raise


def write_text(target: Path, text: str) -> None:
    write(target, text.encode())
