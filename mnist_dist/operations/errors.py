"""The app's errors: ConfigError for bad settings and DataError for bad or missing data (a module of their own, so that
every layer can raise them), and every failure as one line on the console, with the detail kept in the rank's log."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NoReturn


class ConfigError(ValueError):
    """A setting that composes but cannot run; the message is one line with the numbers."""


class DataError(RuntimeError):
    """Bad or missing data; str(e) is ONE line: what is wrong and what to do."""


FILE_ONLY = {"file_only": True}  # log.info(..., extra=FILE_ONLY): the log file, not the console


def describe(error: BaseException) -> str:
    """One line: ``cannot write <path>: No space left on device`` and the like, else the type and first line."""
    if isinstance(error, OSError) and error.filename:
        return f"cannot write {error.filename}: {error.strerror}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def last_resort(error: BaseException, log: Path) -> str:
    """The one line for an error nobody handled, naming ``log``: its traceback goes there unless a worker's did."""
    with suppress(OSError):  # the log cannot be written either (a full disk?): the line is said all the same
        if not (log.is_file() and describe(error) in log.read_text(errors="replace")):
            with open(log, "a") as handle:
                handle.write("".join(traceback.format_exception(error)))
    return f"error: {describe(error)} (log: {log})"


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to ``rank_<r>.log`` in the run directory; rank 0 also to the console, which gets
    neither tracebacks (the launcher prints one ``error:`` line instead) nor ``FILE_ONLY`` records."""
    log = logging.getLogger("mnist_dist")
    log.setLevel(logging.INFO)
    log.propagate = False
    handlers = [logging.FileHandler(run_dir / f"rank_{rank}.log")]
    if rank == 0:
        console = logging.StreamHandler()
        console.addFilter(lambda record: record.exc_info is None and not getattr(record, "file_only", False))
        handlers.append(console)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
    log.handlers[:] = handlers
    # A library thread's error (TensorBoard's writer on a full disk) reaches its caller too: the traceback, the log.
    threading.excepthook = lambda hook: log.error(
        "thread %s failed", hook.thread.name if hook.thread else "?", exc_info=hook.exc_value, extra=FILE_ONLY
    )


NOTHING_STARTED = "interrupted before anything started; nothing was saved"
AGAIN = "interrupted again: stopped at once"
# What stops a command: Ctrl-C, a hang-up, `kill`, SIGUSR1 (a scheduler's warning); a training run checkpoints first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
received: list[int] = []  # the signals that interrupted the command: the last one is its exit status


def on_interrupt(exit_with: str | None = None) -> None:
    """From now on Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 (unless ignored: under ``&`` or nohup) raises KeyboardInterrupt,
    so that ``finally`` clauses stop the workers, and another one ends the process at once; given ``exit_with``, the
    first one does, with that line and 128 + its number (while torch loads, a KeyboardInterrupt is lost or a trace)."""

    def handler(signum: int, frame) -> None:
        received.append(signum)
        if exit_with is None:
            on_interrupt(AGAIN)
            raise KeyboardInterrupt
        for stop in STOP_SIGNALS:  # one line: a press while it is written would say it again
            signal.signal(stop, signal.SIG_IGN)
        os.write(2, f"{exit_with}\n".encode())  # not sys.stderr: the signal may have come in the middle of a write
        os._exit(128 + signum)

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)


def interrupted(message: str, status: int | None = None) -> NoReturn:
    """Ends an interrupted command: ``message`` as its one line, and ``status``, by default 128 + the signal's
    number as a shell gives it (130 for Ctrl-C, 143 for SIGTERM), so that a script tells it from a failure (1)."""
    on_interrupt(AGAIN)  # not the same line twice, as a finished run exits
    sys.stderr.write(f"{message}\n")
    sys.exit(status or 128 + (received[-1] if received else signal.SIGINT))


_status: list[int] = []  # the command's exit status, once it has one: the process then ends as _end_now says


@contextmanager
def command() -> Iterator[None]:
    """Around a command's body: once it has its exit status, the process ends after the other atexit handlers,
    skipping the interpreter's teardown: a second or more (torch), with Ctrl-C back at its default (a silent death)."""
    try:
        yield
    except SystemExit as stop:  # a str is printed by Python before the atexit handlers run: status 1
        _status[:] = [stop.code if isinstance(stop.code, int) else int(stop.code is not None)]
        raise
    _status[:] = [0]


@atexit.register  # before torch is imported, so after the handlers it registers (atexit runs the last first)
def _end_now() -> None:
    if _status:  # log handlers flush every record, and stderr every line
        with suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            sys.stdout.flush()
        os._exit(_status[0])
