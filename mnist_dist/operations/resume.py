"""A run's state into and out of its checkpoint: what a resume needs, saved only from checked weights,
and put back so that the resumed run is the uninterrupted one (its clocks, counts and every rank's random
state included)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mnist_dist.operations import checkpoint
from mnist_dist.parallel import state
from mnist_dist.step import TrainingDiverged, check_finite, first_non_finite

if TYPE_CHECKING:
    from mnist_dist.train import Run

log = logging.getLogger("mnist_dist")


@dataclass
class Losses:
    """The training losses of this log window, kept on the device (no sync per step), and the newest checkpoint
    known to be good, which a divergence error names."""

    window: list[torch.Tensor] = field(default_factory=list)
    good_checkpoint: tuple[Path, int] | None = None  # (path, step): checked when written

    def check(self, step: int, rank: int) -> torch.Tensor | None:
        """The window's losses, up to ``step``; TrainingDiverged names the first that is not finite."""
        return check_finite(torch.stack(self.window), step, rank, self.advice()) if self.window else None

    def advice(self) -> str:
        """What a divergence error says to do; the checkpoint it names was checked when written."""
        if self.good_checkpoint is None:
            return "lower optim.lr or check the data (no checkpoint was written before it)"
        path, step = self.good_checkpoint
        return f"lower optim.lr, check the data, or resume from {path} (step {step}, checked)"


def restore(run: Run, resumed: dict) -> None:
    """Puts a checkpoint's optimizer, scheduler, loss scale, random state and position into ``run``."""
    learner = run.learner
    state.load_optimizer_state(learner.model, learner.optimizer, resumed["optimizer"])
    learner.scheduler.load_state_dict(resumed["scheduler"])
    learner.precision.scaler.load_state_dict(resumed["scaler"])  # fp16: the loss scale it had reached
    run.start, run.step = (resumed["epoch"] + 1, resumed["epoch_step"]), resumed["step"]
    restore_rng(resumed["rng"], run.topology.rank)
    restore_meters(run, resumed["meters"])
    run.losses.good_checkpoint = (Path(run.cfg.resume), run.step)  # checkpoint.load refuses non-finite weights
    log.info("resuming %s at epoch %d, step %d", run.cfg.resume, run.start[0], run.step)


def save_checkpoint(run: Run, epoch: int, epoch_step: int) -> None:
    """Rank 0 saves everything a resume needs, after ``epoch`` epochs and ``epoch_step`` steps of the next (a
    collective). Never from unchecked weights: the losses since the last check are checked here, and rank 0
    checks the weights it writes (a step's update can diverge while its loss was finite)."""
    learner = run.learner
    run.losses.check(run.step, run.topology.rank)
    # Collectives: every rank takes part (fsdp gathers its shards; rank 0 keeps the full state).
    rng = rng_states_of_all_ranks()
    meters = gather_objects(meters_of(run, mid_epoch=epoch_step > 0))
    model_state = state.model_state(learner.model)
    optimizer_state = state.optimizer_state(learner.model, learner.optimizer)
    if run.topology.rank == 0:
        poisoned = first_non_finite(model_state)
        if poisoned:
            raise TrainingDiverged(
                f"the weights are not finite after step {run.step} (rank 0, {poisoned}); {run.losses.advice()}"
            )
        saved = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": learner.scheduler.state_dict(),
            "scaler": learner.precision.scaler.state_dict(),
            "epoch": epoch,
            "epoch_step": epoch_step,
            "step": run.step,
            "rng": rng,
            "meters": meters,
            "world_size": run.topology.world_size,
            "config": run.config_yaml,
            "format": checkpoint.FORMAT,
        }
        checkpoint.save_kept(saved, run.run_dir / "checkpoint.pt", run.cfg.keep_checkpoints)
    run.losses.good_checkpoint = (run.run_dir / "checkpoint.pt", run.step)


def meters_of(run: Run, mid_epoch: bool) -> dict:
    """What this rank has counted so far, for a resumed run to go on counting: its clocks, its images and
    seconds, and mid-epoch the losses of the log window a checkpoint splits."""
    meters = run.meters
    return {
        "train_s": meters.train_time.read(),  # mid-epoch it is running
        "eval_s": meters.eval_time.read(),
        "images": meters.throughput.total_images,
        "images_s": meters.throughput.total_seconds,
        "window_losses": [loss.item() for loss in run.losses.window] if mid_epoch else [],
    }


def restore_meters(run: Run, by_rank: list[dict]) -> None:
    """A resumed run's clocks go on from rank 0's; each rank's counts and split log window from its own, on
    as many ranks as the checkpoint's (on another number, each rank's share is another: they start anew)."""
    meters = run.meters
    meters.train_time.seconds, meters.eval_time.seconds = by_rank[0]["train_s"], by_rank[0]["eval_s"]
    if len(by_rank) != run.topology.world_size:
        return
    mine = by_rank[run.topology.rank]
    meters.throughput.total_images, meters.throughput.total_seconds = mine["images"], mine["images_s"]
    device = run.train_set[0].device
    run.losses.window = [torch.tensor(loss, device=device) for loss in mine["window_losses"]]


def gather_objects(mine: Any) -> list:
    """Every rank's ``mine``, by rank (a collective; ``[mine]`` in one process)."""
    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def rng_states_of_all_ranks() -> list[dict]:
    """Every rank's generators (Python, torch CPU, every CUDA device's), by rank: dropout continues as if
    never stopped, also on the replicas of dp, which draw their masks on every GPU."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return gather_objects({"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda})


def restore_rng(states: list[dict], rank: int) -> None:
    if rank >= len(states):  # resumed on more ranks: new ranks keep their seed
        return
    mine = states[rank]
    random.setstate(mine["python"])
    torch.set_rng_state(mine["torch"])
    if mine["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(mine["cuda"][: torch.cuda.device_count()])
