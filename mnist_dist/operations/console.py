"""What rank 0 shows on the console (docs/running.md): the progress (a tqdm bar in a terminal, else a log line every
``interval_s``, so that a run in CI is visibly alive), and one line of results."""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# tqdm's default lock is a multiprocessing semaphore; a rank killed mid-run (OOM killer, SIGKILL)
# would leave it behind and Python warns about it at exit. Each bar lives in one process anyway.
tqdm.set_lock(threading.RLock())

LOG_INTERVAL_S = 30.0


def summary_line(results: dict) -> str:
    """``test accuracy 89.31 %, loss 0.3012; 234 steps in 0:01:05 (52.1 s training), 4,458 images/s``."""
    wall = timedelta(seconds=round(results["wall_time_s"]))
    speed = f"{results['train_images_per_s']:,.0f} images/s" if results["train_images_per_s"] else "no images/s"
    return (
        f"test accuracy {100 * results['test_accuracy']:.2f} %, loss {results['test_loss']:.4f}; "
        f"{results['steps']} steps in {wall} ({results['train_time_s']:.1f} s training), {speed}"
    )


class Progress:
    """``step()`` after every optimizer step; ``numbers(loss, images_per_s)`` when they are known."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool,
        log: logging.Logger,
        stream: TextIO | None = None,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        initial: int = 0,
    ) -> None:
        """``total_steps`` of the whole run; ``initial`` of them were done before a resume."""
        stream = stream or sys.stderr
        self.total, self.done, self.initial, self.epoch = total_steps, initial, initial, ""
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self.started = clock()
        self.last_line: float | None = None
        self.loss: float | None = None
        self.images_per_s = 0.0
        self.bar = None
        terminal = stream.isatty()
        self.log_lines = enabled and not terminal
        if enabled and terminal:
            # shutil's size, not the terminal's own: a pseudo-terminal never given one (``script``, CI runners,
            # ``docker exec -t``) reports 0x0, and tqdm then prints nothing.
            columns, rows = shutil.get_terminal_size()
            self.bar = tqdm(total=total_steps, initial=initial, file=stream, ncols=columns, nrows=rows, leave=False)
            # Log lines (epoch results) go through tqdm.write, above the bar instead of through it.
            self.redirect = logging_redirect_tqdm([log], tqdm_class=tqdm)
            self.redirect.__enter__()

    def set_epoch(self, epoch: int, epochs: int) -> None:
        self.epoch = f"epoch {epoch}/{epochs}"
        if self.bar:
            self.bar.set_description(self.epoch, refresh=False)

    def step(self) -> None:
        self.done += 1
        if self.bar:
            self.bar.update()
        elif self.log_lines and self.loss is not None:
            now = self.clock()
            if self.last_line is None or now - self.last_line >= self.interval_s:
                self.last_line = now
                self.log.info("%s", self.line(now))

    def numbers(self, loss: float, images_per_s: float | None) -> None:
        self.loss = loss
        if images_per_s:
            self.images_per_s = images_per_s
        if self.bar:
            self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.images_per_s:.0f}", refresh=False)

    def line(self, now: float) -> str:
        per_step = (now - self.started) / max(self.done - self.initial, 1)
        eta = timedelta(seconds=round(per_step * (self.total - self.done)))
        speed = f"{self.images_per_s:,.0f} images/s" if self.images_per_s else "images/s after warm-up"
        return f"step {self.done}/{self.total} ({self.epoch}): loss {self.loss:.4f}, {speed}, ETA {eta}"

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.redirect.__exit__(None, None, None)
