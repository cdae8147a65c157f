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


def describe_os_error(error: OSError) -> str:
    """``cannot write <path>: No space left on device`` and the like; the path when there is one."""
    if error.filename:
        return f"cannot write {error.filename}: {error.strerror}"
    return str(error)


def last_resort(error: BaseException, log: Path) -> str:
    """The one line for an error nobody handled, naming ``log``, where its traceback goes unless a worker logged
    it there already."""
    summary = f"{type(error).__name__}: {error}"
    with suppress(OSError):  # the log cannot be written either (a full disk?): the line is said all the same
        if not (log.is_file() and summary in log.read_text(errors="replace")):
            with open(log, "a") as handle:
                handle.write("".join(traceback.format_exception(error)))
    return f"error: {summary.splitlines()[0]} (log: {log})"


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to ``rank_<r>.log`` in the run directory; rank 0 also to the console, which gets
    neither tracebacks (the launcher prints one ``error:`` line instead) nor ``FILE_ONLY`` records."""
    log = logging.getLogger("mnist_dist")
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    handlers = [logging.FileHandler(run_dir / f"rank_{rank}.log")]
    if rank == 0:
        console = logging.StreamHandler()
        console.addFilter(lambda record: record.exc_info is None and not getattr(record, "file_only", False))
        handlers.append(console)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
        log.addHandler(handler)
    # A library thread that dies (TensorBoard's writer on a full disk) says its error again to its caller, which
    # ends in one line: its traceback goes to the log file only.
    threading.excepthook = lambda hook: log.error(
        "thread %s failed", hook.thread.name if hook.thread else "?", exc_info=hook.exc_value, extra=FILE_ONLY
    )


NOTHING_STARTED = "interrupted before anything started; nothing was saved"
# What stops a command as Ctrl-C does: a terminal's Ctrl-C and hang-up, `kill`, and SIGUSR1 (a scheduler's
# warning; while a run trains, mnist_dist.operations.preemption answers them with a checkpoint instead).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_received: list[int] = []  # the signal that interrupted the command, for its exit status


def exit_on_interrupt(message: str = NOTHING_STARTED) -> None:
    """Until the command's own handling is in place: Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 ends the process at once, with
    ``message`` as its one line and the shell's status for that signal (130 for Ctrl-C). Exits rather than raises: while
    torch and Hydra are imported, a KeyboardInterrupt is a traceback from deep inside the import machinery, or even lost
    (C code that clears the error), leaving the command running."""

    def leave(signum, frame) -> None:
        for stop in STOP_SIGNALS:  # one line: a press while it is written would say it again
            signal.signal(stop, signal.SIG_IGN)
        os.write(2, f"{message}\n".encode())  # not sys.stderr: the signal may have come in the middle of a write
        os._exit(128 + signum)

    _on_stop_signals(leave)


def raise_on_interrupt() -> None:
    """From now on Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 raises KeyboardInterrupt, so that ``finally`` clauses
    run (they stop the workers and tidy the run directory); another one while they run ends the process at
    once (its workers die with it: mnist_dist.parallel.spawn)."""
    _on_stop_signals(lambda signum, frame: stop_now(signum))


def stop_now(signum: int) -> None:
    """Raises KeyboardInterrupt; a signal after it ends the process at once."""
    _received.append(signum)
    exit_on_interrupt("interrupted again: stopped at once")
    raise KeyboardInterrupt


def _on_stop_signals(handler) -> None:
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (SIGINT under ``&``, SIGHUP under nohup)
            signal.signal(signum, handler)


def interrupted(message: str, signum: int | None = None, status: int | None = None) -> NoReturn:
    """Ends an interrupted command: ``message`` as its one line, and ``status``, by default the one a shell gives
    a process that a signal ended (128 + its number: 130 for Ctrl-C, 143 for SIGTERM), so that a script tells an
    interrupt from a failure (1)."""
    exit_on_interrupt("interrupted again: stopped at once")  # not the same line twice, as a finished run exits
    sys.stderr.write(f"{message}\n")
    sys.exit(status or 128 + (signum or (_received[0] if _received else signal.SIGINT)))


_status: list[int] = []  # the command's exit status, once it has one: the process then ends as _end_now says


@contextmanager
def command() -> Iterator[None]:
    """Around a command's body: once it has its exit status, the process ends as soon as the other atexit
    handlers ran, without the interpreter's teardown: it takes seconds (torch's objects) with Ctrl-C back at
    Python's default, where a Ctrl-C would end the command silently, killed by the signal."""
    try:
        yield
    except SystemExit as stop:  # a str is printed by Python before the atexit handlers run: status 1
        _status[:] = [stop.code if isinstance(stop.code, int) else int(stop.code is not None)]
        raise
    _status[:] = [0]


@atexit.register  # before torch is imported, so after the handlers it registers (atexit runs the last first)
def _end_now() -> None:
    if _status:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can be said
                stream.flush()
        os._exit(_status[0])
