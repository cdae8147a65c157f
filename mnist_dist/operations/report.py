"""What a run reports: rank 0's progress on the console, one TensorBoard run per training run, and at its end
model.pt, results.json (naming the machine its numbers came from) and one summary line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mnist_dist.metrics import all_gather, job_images_per_s
from mnist_dist.operations import checkpoint, files, machine
from mnist_dist.operations.errors import FILE_ONLY
from mnist_dist.parallel.state import model_state

if TYPE_CHECKING:
    from mnist_dist.train import Run

log = logging.getLogger("mnist_dist")
# A bar lives in one process: a thread lock, not tqdm's default semaphore, which a rank killed mid-run (OOM killer,
# SIGKILL) leaves behind, with a warning at exit; and no monitor thread in every rank (each has a disabled bar).
tqdm.set_lock(threading.RLock())
tqdm.monitor_interval = 0
# CUSTOM SCALARS (every tag: docs/running.md#tensorboard): {section: {chart title: ["Multiline", [tag regex]]}}: the
# global tags one line per run (per mode in a sweep), the per-rank ones one line per rank and run.
LAYOUT = {
    "compare runs (global numbers)": {
        "training loss, mean over ranks": ["Multiline", [r"^train/loss_global$"]],
        "images/s, all ranks together": ["Multiline", [r"^perf/images_per_s_global$"]],
        "test accuracy": ["Multiline", [r"^test/accuracy$"]],
        "test loss": ["Multiline", [r"^test/loss$"]],
    },
    "per rank (every rank of every run)": {
        "training loss on each rank's share": ["Multiline", [r"^rank_\d+/train/loss$"]],
        "images/s of each rank": ["Multiline", [r"^rank_\d+/perf/images_per_s$"]],
    },
}


class Progress:
    """A tqdm bar when ``enabled`` in a terminal: ``step()`` after each step, ``numbers()`` with each log window's."""

    def __init__(self, total_steps: int, enabled: bool, initial: int = 0) -> None:
        bar = enabled and sys.stderr.isatty()
        # shutil's size, not the terminal's own: a pseudo-terminal never given one (``script``, CI runners,
        # ``docker exec -t``) reports 0x0, and tqdm then prints nothing.
        columns, rows = shutil.get_terminal_size()
        self.bar = tqdm(total=total_steps, initial=initial, ncols=columns, nrows=rows, leave=False, disable=not bar)
        self.redirect = logging_redirect_tqdm([log]) if bar else nullcontext()  # log records go above the bar
        self.redirect.__enter__()
        self.images_per_s = 0.0

    def set_epoch(self, epoch: int, epochs: int) -> None:
        self.bar.set_description(f"epoch {epoch}/{epochs}", refresh=False)

    def step(self) -> None:
        self.bar.update()

    def numbers(self, loss: float, images_per_s: float | None) -> None:
        self.images_per_s = images_per_s or self.images_per_s
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.images_per_s:.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
        self.redirect.__exit__(None, None, None)


def window_tags(gathered: list[list[float]]) -> dict[str, float]:
    """A log window's tags from each rank's ``[loss, images, seconds]``: per rank, the mean loss, the job's images/s."""
    tags = {}
    for rank, (loss, images, seconds) in enumerate(gathered):
        tags[f"rank_{rank}/train/loss"] = loss
        if seconds:
            tags[f"rank_{rank}/perf/images_per_s"] = images / seconds
    tags["train/loss_global"] = sum(row[0] for row in gathered) / len(gathered)
    if rate := job_images_per_s([(row[1], row[2]) for row in gathered]):
        tags["perf/images_per_s_global"] = rate
    return tags


class Scalars:
    """The run's TensorBoard directory ``<run>/tb``, written by rank 0 alone and opened by its first write (a run that
    fails before it logs leaves none); what an earlier attempt logged after ``resumed_step`` is purged: one stream."""

    def __init__(self, run_dir: Path, rank: int, resumed_step: int | None = None) -> None:
        self.directory, self.rank = run_dir / "tb", rank
        self.purge_step = 0 if resumed_step is None else resumed_step + 1
        self.writer: SummaryWriter | None = None

    def add(self, step: int, **tags: float) -> None:
        if self.rank == 0 and self.writer is None:
            self.writer = SummaryWriter(str(self.directory), purge_step=self.purge_step)
            self.writer.add_custom_scalars(LAYOUT)
        if self.writer is not None:
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def summary_line(results: dict) -> str:
    """``test accuracy 89.31 %, loss 0.3012; 234 steps in 0:01:05 (52.1 s training), 4,458 images/s``."""
    wall = timedelta(seconds=round(results["wall_time_s"]))
    speed = f"{results['train_images_per_s']:,.0f} images/s" if results["train_images_per_s"] else "no images/s"
    return (
        f"test accuracy {100 * results['test_accuracy']:.2f} %, loss {results['test_loss']:.4f}; "
        f"{results['steps']} steps in {wall} ({results['train_time_s']:.1f} s training), {speed}"
    )


def finish(run: Run, wall_time_s: float) -> dict:
    """model.pt and results.json (rank 0); every rank leaves the process group together."""
    cfg, topology, meters, score = run.cfg, run.topology, run.meters, run.score
    # every rank's [images, seconds, MiB of parameters, gradients and optimizer state after a step: shards in fsdp]
    by_rank = all_gather([meters.throughput.total_images, meters.throughput.total_seconds, meters.state_bytes / 2**20])
    results = {
        "mode": cfg.mode.name,  # the choice (dp_block, not dp)
        "world_size": topology.world_size,
        "device": topology.device_type,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "test_accuracy": score.accuracy,
        "test_loss": score.loss,
        "steps": run.step,
        # Time to accuracy: training time only, without evaluation (eval_time_s); null when not reached.
        "target_accuracy": cfg.target_accuracy or None,
        "steps_to_target": score.steps_to_target,
        "time_to_target_s": score.time_to_target_s,
        "train_time_s": meters.train_time.seconds,
        "eval_time_s": meters.eval_time.seconds,
        "train_images_per_s": job_images_per_s([row[:2] for row in by_rank]),
        "wall_time_s": wall_time_s,
        "model_state_mib": [row[2] for row in by_rank],
        "machine": machine.describe(),  # rank 0's view: its torch threads, after the CPU was shared
    }
    saved_model = model_state(run.learner.model)  # a collective in fsdp
    if topology.rank == 0:
        checkpoint.save(saved_model, run.run_dir / "model.pt")
        save_json(results, run.run_dir / "results.json")
        log.info("results: %s", results, extra=FILE_ONLY)  # the console gets the summary
        if busy := machine.load_warning(os.getloadavg()[0]):  # a sweep's speeds too: each run says it
            log.warning("%s", busy)
        log.info("%s", summary_line(results))
        log.info("run directory: %s", run.run_dir.resolve())
    if dist.is_initialized():
        dist.barrier()  # leave together: a peer that disconnects while rank 0 still saves can abort it
        dist.destroy_process_group()
    return results


def save_json(obj: dict, path: Path) -> None:
    """Strict JSON, atomically: a nan or inf is written as null (a bare NaN is refused by strict parsers)."""
    plain = json.loads(json.dumps(obj), parse_constant=lambda nan_or_inf: None)
    files.write_text(path, json.dumps(plain, indent=2, allow_nan=False) + "\n")
