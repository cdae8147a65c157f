"""What rank 0 shows on the console (docs/running.md): its progress, and one line of results."""

from __future__ import annotations

import logging
import math
import shutil
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# A bar lives in one process: a thread lock, not tqdm's default semaphore, which a rank killed mid-run (OOM killer,
# SIGKILL) leaves behind, with a warning at exit; and no monitor thread in every rank (each has a disabled bar).
tqdm.set_lock(threading.RLock())
tqdm.monitor_interval = 0


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
        bar = enabled and sys.stderr.isatty()
        # shutil's size, not the terminal's own: a pseudo-terminal never given one (``script``, CI runners,
        # ``docker exec -t``) reports 0x0, and tqdm then prints nothing.
        columns, rows = shutil.get_terminal_size()
        self.bar = tqdm(total=total_steps, initial=initial, ncols=columns, nrows=rows, leave=False, disable=not bar)
        self.redirect = logging_redirect_tqdm([log]) if bar else nullcontext()  # log records go above the bar
        self.redirect.__enter__()
        self.log, self.done, self.epoch, self.loss, self.images_per_s = log, initial, "", None, 0.0
        self.next_line = 0.0 if enabled and not bar else math.inf

    def set_epoch(self, epoch: int, epochs: int) -> None:
        self.epoch = f"epoch {epoch}/{epochs}"
        self.bar.set_description(self.epoch, refresh=False)

    def step(self) -> None:
        self.bar.update()
        self.done += 1
        if self.loss is not None and time.monotonic() >= self.next_line:
            self.next_line = time.monotonic() + 30
            line = "step %d/%d (%s): loss %.4f, %.0f images/s"
            self.log.info(line, self.done, self.bar.total, self.epoch, self.loss, self.images_per_s)

    def numbers(self, loss: float, images_per_s: float | None) -> None:
        self.loss, self.images_per_s = loss, images_per_s or self.images_per_s
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.images_per_s:.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
        self.redirect.__exit__(None, None, None)
