"""The worker: build → run the epochs (train, evaluate) → finish, the same code in every mode and on every rank.

It gets a plain config, plain paths and its topology (never Hydra globals) and never touches the
network: the parent prepared the data before this process existed. A resumed run reads its checkpoint
once, in ``train``; ``build`` puts the weights into the plain model and ``resume.restore`` the rest. What one
step computes (the optimizer step, evaluation) is in mnist_dist/step.py; this module runs the loop.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from mnist_dist.config import Config
from mnist_dist.data import epoch_order, load_split, rank_batches, steps_per_epoch, to_device_tensors
from mnist_dist.metrics import (
    StepTimer,
    Stopwatch,
    Throughput,
    all_gather,
    ddp_counters_ms,
    job_images_per_s,
    state_bytes,
)
from mnist_dist.model import instantiate_model, make_scheduler
from mnist_dist.modes import MODES, wrap_model
from mnist_dist.operations import checkpoint, preemption, profiling
from mnist_dist.operations.console import Progress
from mnist_dist.operations.errors import FILE_ONLY, NoFollowFileHandler, console_handler, log_thread_errors
from mnist_dist.operations.results import finish
from mnist_dist.operations.resume import diverged_advice, restore, save_checkpoint
from mnist_dist.operations.tensorboard import Scalars
from mnist_dist.step import Precision, TrainingDiverged, check_finite, evaluate_as_saved, train_step
from mnist_dist.topology import Topology

log = logging.getLogger("mnist_dist")


@dataclass
class Run:
    """What a worker builds once and every step of it uses."""

    cfg: Config
    topology: Topology
    run_dir: Path
    config_yaml: str
    scalars: Scalars
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    throughput: Throughput
    timer: StepTimer
    progress: Progress | None = None  # set once the run knows where it starts
    profiler: torch.profiler.profile | None = None  # profile=true
    first_epoch: int = 1
    skip: int = 0  # steps of first_epoch a mid-epoch checkpoint had done
    step: int = 0  # optimizer steps taken, over all epochs
    test_loss: float = float("nan")
    test_accuracy: float = float("nan")
    state_bytes: int = 0  # the most parameter, gradient and optimizer bytes this rank held after a step
    evaluated_step: int = -1  # the step whose model test_loss and test_accuracy describe
    steps_to_target: int | None = None  # the first evaluated step at or above cfg.target_accuracy
    time_to_target_s: float | None = None  # training time (train_clock) up to that step
    scheduler_per_step: bool = False  # a schedule over all steps (OneCycle), not stepped per epoch
    window_losses: list[torch.Tensor] = field(default_factory=list)  # this log window's, on the device
    good_checkpoint: tuple[Path, int] | None = None  # the newest checkpoint (path, step): checked when written

    def __post_init__(self) -> None:
        self.train_clock, self.eval_clock = Stopwatch(self.topology.devices), Stopwatch(self.topology.devices)


def train(cfg: Config, run_dir: Path, raw_dir: Path, topology: Topology) -> dict:
    """Trains and evaluates; rank 0 writes checkpoints and results.json. Returns the results."""
    started = time.perf_counter()
    setup_logging(run_dir, topology.rank)
    device = topology.device  # mnist_dist.topology.setup_process set this process up
    resumed = checkpoint.load(Path(cfg.resume)) if cfg.resume else None
    # On resume, TensorBoard keeps what was logged up to the checkpoint and drops what came after it.
    resumed_at = (resumed["step"], 1000 * resumed["meters"][0]["train_s"]) if resumed else None
    scalars = Scalars(run_dir, topology.rank, resumed_at)
    try:
        run = build(cfg, topology, run_dir, raw_dir, device, scalars, resumed)
        for epoch in range(run.first_epoch, cfg.epochs + 1):
            epoch_started = time.perf_counter()
            run_epoch(run, epoch)
            evaluate_epoch(run, epoch, epoch_started)
            if run.steps_to_target is not None:
                break
        if run.profiler:
            run.profiler.stop()
        run.progress.close()
        return finish(run, time.perf_counter() - started)
    except Exception:
        # The process group is left as it is: closing it now would make the other ranks fail
        # before this one has reported, and the launcher names the rank that failed first.
        log.exception("rank %d failed", topology.rank)
        raise
    finally:
        scalars.close()


def build(
    cfg: Config,
    topology: Topology,
    run_dir: Path,
    raw_dir: Path,
    device: torch.device,
    scalars: Scalars,
    resumed: dict | None,
) -> Run:
    """Data on the device, the wrapped model, optimizer, scheduler and meters; a resumed run's state."""
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if topology.rank == 0:
        log.info("config:\n%s", config_yaml, extra=FILE_ONLY)  # the console has launch's one line
        checkpoint.save_text(config_yaml, run_dir / "config.yaml")  # replaces a planted symlink, never follows it
    train_x, train_y = to_device_tensors(*load_split(raw_dir, train=True), cfg.data.mean, cfg.data.std, device)
    test_x, test_y = to_device_tensors(*load_split(raw_dir, train=False), cfg.data.mean, cfg.data.std, device)
    if cfg.channels_last:  # NHWC: what tensor-core convolutions read without a transpose
        train_x, test_x = (t.contiguous(memory_format=torch.channels_last) for t in (train_x, test_x))
    model = wrap_model(build_model(cfg, resumed), cfg.mode, device, topology.gpus)
    random.seed(cfg.seed + topology.rank)
    torch.manual_seed(cfg.seed + topology.rank)  # each rank its own dropout masks, repeatably
    optimizer = instantiate(cfg.optim)(model.parameters())
    steps = steps_per_epoch(len(train_x), cfg.batch_size)
    scheduler, per_step = make_scheduler(cfg.scheduler, optimizer, steps * cfg.epochs)
    run = Run(
        cfg,
        topology,
        run_dir,
        config_yaml,
        scalars,
        train_x,
        train_y,
        test_x,
        test_y,
        model,
        optimizer,
        scheduler,
        Precision(cfg.amp, device),
        Throughput(topology.devices, cfg.warmup_steps),  # dp and split: every device they compute on
        StepTimer(topology.devices, model, optimizer),
        scheduler_per_step=per_step,
    )
    if resumed:
        restore(run, resumed)
    if cfg.profile:
        run.profiler = profiling.start(run_dir, topology.rank, cfg.warmup_steps, device)
    run.progress = Progress(steps * cfg.epochs, topology.rank == 0 and cfg.progress, log, initial=run.step)
    log.info(
        "%s on %s: %d rank(s), global batch %d (%d per rank), %d steps per epoch",
        cfg.mode.name,
        topology.device_type,
        topology.world_size,
        cfg.batch_size,
        topology.batch,
        steps,
    )
    return run


def build_model(cfg: Config, resumed: dict | None) -> nn.Module:
    """The plain model, before any mode wraps it: the same initial weights in every mode and on every rank."""
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model)  # a bad model._target_ is one line saying what to do
    if resumed:
        model.load_state_dict(resumed["model"])  # into the plain model, before any wrapper
    if cfg.channels_last and MODES[cfg.mode.name].channels_last_weights:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model.compile()  # in place: parameter names, hooks and checkpoints stay as they are
    return model


def run_epoch(run: Run, epoch: int) -> None:
    """One pass over the training set: this rank's share of every global batch, in the epoch's order."""
    cfg, rank = run.cfg, run.topology.rank
    run.model.train()
    order = epoch_order(len(run.train_x), cfg.seed, epoch).to(run.train_x.device)
    run.progress.set_epoch(epoch, cfg.epochs)
    batches = rank_batches(order, cfg.batch_size, rank, run.topology.world_size)
    done, run.skip = run.skip, 0  # after a mid-epoch checkpoint: go on from its position
    if not done:
        run.window_losses = []  # kept on the device: no sync per step
    run.train_clock.start()
    for position, indices in enumerate(islice(batches, done, None), start=done + 1):
        run.step += 1
        run.timer.start(sample=run.step % cfg.log_every == 0)  # the last step of each window is timed
        x, y = run.train_x[indices], run.train_y[indices]
        run.timer.mark("data")
        loss = train_step(run.model, run.optimizer, x, y, run.precision, cfg.accumulate, cfg.label_smoothing)
        if run.scheduler_per_step:
            run.scheduler.step()
        run.window_losses.append(loss.detach())
        run.throughput.step(len(indices))
        if run.step % cfg.log_every == 0:
            run.state_bytes = max(run.state_bytes, state_bytes(run.model, run.optimizer))  # gradients still held
            losses = check_finite(torch.stack(run.window_losses), run.step, rank, diverged_advice(run))
            log_window(run, losses.mean().item())
            run.window_losses = []
        run.progress.step()
        between_steps(run, epoch, position)
        if cfg.eval_every_steps and run.step % cfg.eval_every_steps == 0 and evaluate_now(run):
            break  # the target is reached
    run.train_clock.stop()
    if run.window_losses:  # the epoch's last steps, short of a full window
        check_finite(torch.stack(run.window_losses), run.step, rank, diverged_advice(run))
    run.throughput.pause()


def between_steps(run: Run, epoch: int, position: int) -> None:
    """After step ``position`` of ``epoch``, outside the step: the profiler's step, the mid-epoch
    checkpoint, and a stop that a scheduler asked for (mnist_dist/operations/preemption.py)."""
    if run.profiler:
        run.profiler.step()
    every, last = run.cfg.checkpoint_every_steps, steps_per_epoch(len(run.train_x), run.cfg.batch_size)
    stop = preemption.requested(run.step)
    if stop or (every and run.step % every == 0 and position < last):  # at the last, the epoch's own follows
        save_checkpoint(run, epoch - 1, position)
    if stop:
        raise preemption.Stopped(
            f"stopped by {stop} after step {run.step}; the run goes on from {run.run_dir}/checkpoint.pt when "
            "started again with resume=auto"
        )


def evaluate_now(run: Run) -> bool:
    """Exact test loss and accuracy of the model at this step, off the training clock (a collective: every
    rank calls it at the same step). True when ``cfg.target_accuracy`` is set and reached."""
    run.throughput.pause()  # the next step starts its clock again
    with run.train_clock.paused():
        run.eval_clock.start()
        with run.precision.autocast():
            run.test_loss, run.test_accuracy = evaluate_as_saved(
                run.model,
                run.test_x,
                run.test_y,
                run.cfg.test_batch_size,
                run.topology.rank,
                run.topology.world_size,
            )
        run.eval_clock.stop()
    if not math.isfinite(run.test_loss):  # the last step's update diverged: its training loss was still finite
        raise TrainingDiverged(
            f"the test loss is {run.test_loss} after step {run.step} (rank {run.topology.rank}); {diverged_advice(run)}"
        )
    run.model.train()  # evaluate() left it in eval mode; a mid-epoch evaluation goes on training
    run.evaluated_step = run.step
    target = run.cfg.target_accuracy
    if target and run.test_accuracy >= target and run.steps_to_target is None:
        run.steps_to_target, run.time_to_target_s = run.step, run.train_clock.seconds
        log.info(
            "target accuracy %.2f %% reached at step %d, %.1f s of training",
            100 * target,
            run.step,
            run.time_to_target_s,
        )
    run.scalars.add(run.step, **{"test/loss": run.test_loss, "test/accuracy": run.test_accuracy})  # rank 0 writes
    # TensorBoard's x axis is an integer step: training milliseconds make it a time axis without evaluation.
    run.scalars.add(round(1000 * run.train_clock.seconds), **{"test/accuracy_by_train_ms": run.test_accuracy})
    return run.steps_to_target is not None


def evaluate_epoch(run: Run, epoch: int, epoch_started: float) -> None:
    """Test loss and accuracy (unless this step's model was just evaluated), the scheduler's step, and
    (rank 0) the scalars and the checkpoint."""
    if run.evaluated_step != run.step:
        evaluate_now(run)
    if not run.scheduler_per_step:
        run.scheduler.step()
    epoch_seconds = time.perf_counter() - epoch_started
    run.scalars.add(run.step, **{"perf/epoch_time_s": epoch_seconds})  # rank 0 writes
    save_checkpoint(run, epoch, 0)
    log.info(
        "epoch %d: test loss %.4f, accuracy %.2f %%, %.1f s",
        epoch,
        run.test_loss,
        100 * run.test_accuracy,
        epoch_seconds,
    )


def log_window(run: Run, loss: float) -> None:
    """Rank 0 writes every rank's numbers and the job's: one gather, a collective that all ranks call."""
    images, seconds = run.throughput.lap() or (0, 0.0)
    counters = ddp_counters_ms(run.model)  # the same keys on every rank: the DDP modes have them, others not
    gathered = all_gather([loss, images, seconds, *run.timer.lap().values(), *counters.values()])
    if run.topology.rank != 0:
        return
    tags = {}
    names = [*StepTimer.PHASES, *counters]
    for rank, (rank_loss, rank_images, rank_seconds, *times_ms) in enumerate(gathered):
        tags[f"rank_{rank}/train/loss"] = rank_loss
        if rank_seconds:
            tags[f"rank_{rank}/perf/images_per_s"] = rank_images / rank_seconds
        tags.update({f"rank_{rank}/time/{name}_ms": ms for name, ms in zip(names, times_ms, strict=True)})
    global_loss = sum(values[0] for values in gathered) / len(gathered)
    rate = job_images_per_s([(values[1], values[2]) for values in gathered])
    tags.update({"train/loss_global": global_loss, "train/lr": run.optimizer.param_groups[0]["lr"]})
    if rate:
        tags["perf/images_per_s_global"] = rate
    run.progress.numbers(global_loss, rate)
    run.scalars.add(run.step, **tags)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to ``rank_<r>.log`` in the run directory; rank 0 also to the console."""
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    handlers = [NoFollowFileHandler(run_dir / f"rank_{rank}.log")]  # a planted symlink is refused
    if rank == 0:
        handlers.append(console_handler())  # tracebacks and the full config go to the log file only
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log_thread_errors(log)
