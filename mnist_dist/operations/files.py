"""How the app writes and opens files: the one atomic write that every file written whole goes through
(docs/reliability.md), and opening that follows no link and waits on no FIFO.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, NamedTuple

_NOT_REGULAR = "not a regular file (a FIFO? a device?), which mnist_dist neither reads nor writes; remove it"
_NOT_OURS = "not a directory of this run (a symbolic link?), which mnist_dist does not write into; remove it"
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Pending(NamedTuple):
    """A file being written: ``file`` to write to, ``path`` (the temp name) to read it back by."""

    file: BinaryIO
    path: Path


def create_new(directory: Path, name: str, suffix: str = ".tmp") -> Pending:
    """A new file ``.<name>.<random><suffix>`` in ``directory``, with the user's umask (mkstemp's 0600
    would hide the results from a teammate sharing the directory)."""
    path = directory / f".{name}.{secrets.token_hex(8)}{suffix}"
    return Pending(os.fdopen(os.open(path, _NEW, 0o666), "wb"), path)


@contextmanager
def atomic(target: Path) -> Iterator[Pending]:
    """Yields a new temp file beside ``target`` (O_EXCL|O_NOFOLLOW: nothing planted there is followed); once the body
    returns, it holds the bytes on disk and replaces ``target`` in one step (a link there is replaced, its target
    untouched). If the body raises, the temp file goes and ``target`` is as it was. An OSError names ``target`` (a write
    to a descriptor names no file). A write killed by a signal leaves its temp file: the next write of the same target
    removes it (run directories and the data root's raw/ are written by one process at a time: the run's lock, prepare's
    lock)."""
    target = Path(target)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        stale.unlink(missing_ok=True)  # a link itself, never its target
    try:
        pending = create_new(target.parent, target.name)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(target)) from None
    try:
        with pending.file:
            yield pending
            pending.file.flush()
            os.fsync(pending.file.fileno())
        os.replace(pending.path, target)  # a symlink at ``target`` is replaced; what it pointed to is left alone
        _fsync_dir(target.parent)
    except OSError as error:
        pending.path.unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror, str(target)) from None
    except BaseException:
        pending.path.unlink(missing_ok=True)
        raise


def write(target: Path, data: bytes | memoryview) -> None:
    """``data`` into ``target``, atomically (``atomic``)."""
    with atomic(target) as pending:
        pending.file.write(data)


def write_text(target: Path, text: str) -> None:
    write(target, text.encode())


def _fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory's entry is on disk too.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync a directory
            raise
    finally:
        os.close(fd)


def own_directory(path: Path) -> Path:
    """``path`` as a directory of the run's own: created, or an existing real one; a link planted there (to
    another run's directory, say) is refused, never written into (OSError naming it)."""
    with suppress(FileExistsError):
        os.mkdir(path)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(errno.ENOTDIR, _NOT_OURS, str(path))
    return path


def open_regular(path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A descriptor of ``path`` opened with ``flags``, refused (OSError naming it) unless it is a regular
    file: a FIFO would block the open or the read forever, a device (``/dev/zero``) never end. The open
    itself cannot block (O_NONBLOCK, cleared once the file is known to be regular)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno != errno.ENXIO:  # ENXIO: a FIFO opened for writing that nobody reads
            raise
        raise OSError(errno.EINVAL, _NOT_REGULAR, str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, _NOT_REGULAR, str(path))
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd
