"""The atomic write that every file written whole goes through: a temp file beside the target, fsync, os.replace."""

from __future__ import annotations

import glob
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic(target: Path) -> Iterator[BinaryIO]:
    """Yields a temp file beside ``target`` that replaces it, on disk, once the body returns: a crash or a signal at
    any moment leaves the old file or the new one, whole. An OSError names ``target`` (a write to a descriptor names
    no file). A write killed by a signal leaves its temp file: the next write of the same target removes it."""
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        stale.unlink(missing_ok=True)
    temp = target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"
    try:
        with open(temp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(target)) from None
        raise


def write(target: Path, data: bytes | memoryview) -> None:
    with atomic(target) as file:
        file.write(data)


def write_text(target: Path, text: str) -> None:
    write(target, text.encode())
