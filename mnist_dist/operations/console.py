"""What rank 0 shows on the console (docs/running.md): its progress, and one line of results."""

from __future__ import annotations

import logging
import math
import shutil
import sys
import threading
import time
from datetime import timedelta

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# tqdm's default lock is a multiprocessing semaphore; a rank killed mid-run (OOM killer, SIGKILL)
# would leave it behind and Python warns about it at exit. Each bar lives in one process anyway.
tqdm.set_lock(threading.RLock())


def summary_line(results: dict) -> str:
    """``test accuracy 89.31 %, loss 0.3012; 234 steps in 0:01:05 (52.1 s training), 4,458 images/s``."""
    wall = timedelta(seconds=round(results["wall_time_s"]))
    speed = f"{results['train_images_per_s']:,.0f} images/s" if results["train_images_per_s"] else "no images/s"
    return (
        f"test accuracy {100 * results['test_accuracy']:.2f} %, loss {results['test_loss']:.4f}; "
        f"{results['steps']} steps in {wall} ({results['train_time_s']:.1f} s training), {speed}"
    )


class Progress:
    """When ``enabled``: a tqdm bar in a terminal, else a log line at most every 30 s (a run in CI is visibly
    alive). ``step()`` after every optimizer step, ``numbers()`` with each log window's loss and images/s."""

    def __init__(self, total_steps: int, enabled: bool, log: logging.Logger, initial: int = 0) -> None:
        self.total, self.done, self.log, self.epoch = total_steps, initial, log, ""
        self.loss, self.images_per_s, self.next_line = None, 0.0, 0.0 if enabled else math.inf
        self.bar = None
        if enabled and sys.stderr.isatty():
            # shutil's size, not the terminal's own: a pseudo-terminal never given one (``script``, CI runners,
            # ``docker exec -t``) reports 0x0, and tqdm then prints nothing.
            columns, rows = shutil.get_terminal_size()
            self.bar = tqdm(total=total_steps, initial=initial, ncols=columns, nrows=rows, leave=False)
            self.redirect = logging_redirect_tqdm([log])  # log records go above the bar, not through it
            self.redirect.__enter__()

    def set_epoch(self, epoch: int, epochs: int) -> None:
        self.epoch = f"epoch {epoch}/{epochs}"
        if self.bar:
            self.bar.set_description(self.epoch, refresh=False)

    def step(self) -> None:
        self.done += 1
        if self.bar:
            self.bar.update()
        elif self.loss is not None and time.monotonic() >= self.next_line:
            self.next_line = time.monotonic() + 30
            line = "step %d/%d (%s): loss %.4f, %.0f images/s"
            self.log.info(line, self.done, self.total, self.epoch, self.loss, self.images_per_s)

    def numbers(self, loss: float, images_per_s: float | None) -> None:
        self.loss, self.images_per_s = loss, images_per_s or self.images_per_s
        if self.bar:
            self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.images_per_s:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.redirect.__exit__(None, None, None)
