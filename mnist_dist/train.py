"""The worker: build → the epochs → finish, the same code in every mode and on every rank. Each epoch is one
loop (``train_epoch``): batch → ``train_step`` → every ``log_every`` steps one synchronised log window → at its
end the evaluation and the checkpoint."""

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
from torch.profiler import ProfilerActivity, schedule

from mnist_dist.config import Config
from mnist_dist.data import epoch_order, load_split, rank_batches, steps_per_epoch, to_device_tensors
from mnist_dist.metrics import Meters, all_gather, state_bytes
from mnist_dist.model import instantiate_model, make_scheduler
from mnist_dist.modes import wrap_model
from mnist_dist.operations import checkpoint, files, preemption
from mnist_dist.operations.checkpoint import restore, save_checkpoint
from mnist_dist.operations.errors import FILE_ONLY, setup_logging
from mnist_dist.operations.report import Progress, Scalars, finish, window_tags
from mnist_dist.step import ADVICE, Precision, TrainingDiverged, check_finite, evaluate_as_saved, train_step
from mnist_dist.topology import Topology

log = logging.getLogger("mnist_dist")


@dataclass
class Learner:
    """The wrapped model and what updates it: what a checkpoint saves besides the run's position."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    per_step: bool  # a schedule over all steps (OneCycle) steps after each; the others after each epoch
    precision: Precision


@dataclass
class Score:
    """The last evaluation, and the first that reached ``cfg.target_accuracy``."""

    loss: float = float("nan")
    accuracy: float = float("nan")
    steps_to_target: int | None = None
    time_to_target_s: float | None = None  # training time (meters.train_time) up to that step


@dataclass
class Run:
    """What a worker builds once, and where the loop has got to: the loop advances it, a resume sets it once."""

    cfg: Config
    topology: Topology
    run_dir: Path
    config_yaml: str
    scalars: Scalars
    train_set: tuple[torch.Tensor, torch.Tensor]  # images and labels, on the device
    test_set: tuple[torch.Tensor, torch.Tensor]
    learner: Learner
    meters: Meters  # this rank's clocks and counts
    step: int = 0  # optimizer steps taken, over all epochs
    losses: list[torch.Tensor] = field(default_factory=list)  # this log window's, on the device: no sync per step
    score: Score = field(default_factory=Score)


def train(cfg: Config, run_dir: Path, raw_dir: Path, topology: Topology) -> dict:
    """Trains and evaluates; rank 0 writes checkpoints and results.json. Returns the results."""
    started = time.perf_counter()
    setup_logging(run_dir, topology.rank)
    resumed = checkpoint.load(Path(cfg.resume)) if cfg.resume else None
    scalars = Scalars(run_dir, topology.rank, resumed["step"] if resumed else None)
    try:
        run = build(cfg, topology, run_dir, raw_dir, scalars, resumed)
        steps = steps_per_epoch(len(run.train_set[0]), cfg.batch_size)
        progress = Progress(steps * cfg.epochs, topology.rank == 0 and cfg.progress, initial=run.step)
        profiler = start_profiler(run_dir, topology, cfg.warmup_steps) if cfg.profile else None
        first_epoch, done = (resumed["epoch"] + 1, resumed["epoch_step"]) if resumed else (1, 0)
        for epoch in range(first_epoch, cfg.epochs + 1):
            train_epoch(run, epoch, done if epoch == first_epoch else 0, progress, profiler)
            if run.score.steps_to_target is not None:
                break
        if profiler:
            profiler.stop()
        progress.close()
        return finish(run, time.perf_counter() - started)
    except Exception:
        # The process group is left as it is: closing it now would make the other ranks fail
        # before this one has reported, and the launcher names the rank that failed first.
        log.exception("rank %d failed", topology.rank)
        raise
    finally:
        scalars.close()


def start_profiler(run_dir: Path, topology: Topology, warmup_steps: int) -> torch.profiler.profile:
    """``profile=true``: this rank's Chrome trace of 5 steps after warm-up and one step the profiler discards
    (``trace_rank<r>.json``, for ui.perfetto.dev); ``step()`` after each training step."""
    cuda = [ProfilerActivity.CUDA] if topology.device.type == "cuda" else []
    profiler = torch.profiler.profile(
        activities=[ProfilerActivity.CPU, *cuda],
        schedule=schedule(wait=warmup_steps, warmup=1, active=5, repeat=1),
        on_trace_ready=lambda done: done.export_chrome_trace(str(run_dir / f"trace_rank{topology.rank}.json")),
    )
    profiler.start()
    return profiler


def build(cfg: Config, topology: Topology, run_dir: Path, raw_dir: Path, scalars: Scalars, resumed: dict | None) -> Run:
    """Data on the device, the wrapped model, optimizer, scheduler and meters; a resumed run's state."""
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    device = topology.device
    data = [to_device_tensors(*load_split(raw_dir, t), cfg.data.mean, cfg.data.std, device) for t in (True, False)]
    if cfg.channels_last:  # NHWC: what tensor-core convolutions read without a transpose
        data = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in data]
    train_set, test_set = data
    model = wrap_model(build_model(cfg, resumed), cfg.mode, device, topology.gpus)
    random.seed(cfg.seed + topology.rank)
    torch.manual_seed(cfg.seed + topology.rank)  # each rank its own dropout masks, repeatably
    optimizer = instantiate(cfg.optim)(model.parameters())
    steps = steps_per_epoch(len(train_set[0]), cfg.batch_size)
    scheduler, per_step = make_scheduler(cfg.scheduler, optimizer, steps * cfg.epochs)
    learner = Learner(model, optimizer, scheduler, per_step, Precision(cfg.amp, device))
    meters = Meters(topology.devices, cfg.warmup_steps)  # dp and split: they wait for every device computing
    run = Run(cfg, topology, run_dir, config_yaml, scalars, train_set, test_set, learner, meters)
    if resumed:
        restore(run, resumed)
    if topology.rank == 0:  # once the checkpoint fits: a failed resume leaves the run's config.yaml as it was
        log.info("config:\n%s", config_yaml, extra=FILE_ONLY)  # the console has launch's one line
        files.write_text(run_dir / "config.yaml", config_yaml)
    where, size = f"{cfg.mode.name} on {topology.device_type}", topology.world_size
    per_rank = f"global batch {cfg.batch_size} ({cfg.batch_size // size} per rank), {steps} steps per epoch"
    log.info("%s: %d rank(s), %s", where, size, per_rank)
    return run


def build_model(cfg: Config, resumed: dict | None) -> nn.Module:
    """The plain model, before any mode wraps it: the same initial weights in every mode and on every rank."""
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model)  # a bad model._target_ is one line saying what to do
    if resumed:
        model.load_state_dict(resumed["model"])
    # fully_shard requires contiguous weights: in fsdp only the images (so the activations) are NHWC.
    if cfg.channels_last and cfg.mode.name != "fsdp":
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model.compile()  # in place: parameter names, hooks and checkpoints stay as they are
    return model


def train_epoch(run: Run, epoch: int, done: int, progress: Progress, profiler: torch.profiler.profile | None) -> None:
    """One pass over the training set after its first ``done`` steps, each rank on its share of every global
    batch; then the test set and the checkpoint."""
    cfg, learner, meters, (train_x, train_y) = run.cfg, run.learner, run.meters, run.train_set
    started, last = time.perf_counter(), steps_per_epoch(len(train_x), cfg.batch_size)
    learner.model.train()
    order = epoch_order(len(train_x), cfg.seed, epoch).to(train_x.device)
    batches = rank_batches(order, cfg.batch_size, run.topology.rank, run.topology.world_size)
    progress.set_epoch(epoch, cfg.epochs)
    if not done:  # after a mid-epoch checkpoint, its log window goes on
        run.losses = []
    evaluated = False
    meters.train_time.start()
    for position, indices in enumerate(islice(batches, done, None), start=done + 1):
        run.step += 1
        x, y = train_x[indices], train_y[indices]
        loss = train_step(
            learner.model, learner.optimizer, x, y, learner.precision, cfg.accumulate, cfg.label_smoothing
        )
        if learner.per_step:
            learner.scheduler.step()
        run.losses.append(loss.detach())
        meters.throughput.step(len(indices))
        if run.step % cfg.log_every == 0:
            log_window(run, progress)
        progress.step()
        if profiler:
            profiler.step()
        stop = preemption.requested()  # a collective vote on a scheduler's signal, one step late
        if stop or (cfg.checkpoint_every_steps and run.step % cfg.checkpoint_every_steps == 0 and position < last):
            save_checkpoint(run, epoch - 1, position)  # at the epoch's last step, the epoch's own follows
        if stop:
            raise preemption.Stopped(
                f"stopped by {stop} after step {run.step}; the run goes on from {run.run_dir}/checkpoint.pt when "
                "started again with resume=auto"
            )
        evaluated = cfg.eval_every_steps > 0 and run.step % cfg.eval_every_steps == 0
        if evaluated:
            meters.train_time.stop()  # evaluation is off the training clock
            meters.throughput.pause()  # and out of images/s: the next step starts that clock again
            if evaluate(run):
                break  # the target is reached
            meters.train_time.start()
    meters.train_time.stop()
    check_finite(run.losses, run.step, run.topology.rank)  # the epoch's last steps, short of a full window
    meters.throughput.pause()
    if not evaluated:
        evaluate(run)
    if not learner.per_step:
        learner.scheduler.step()
    seconds = time.perf_counter() - started
    run.scalars.add(run.step, **{"perf/epoch_time_s": seconds})  # rank 0 writes
    save_checkpoint(run, epoch, 0)
    score = run.score
    log.info("epoch %d: test loss %.4f, accuracy %.2f %%, %.1f s", epoch, score.loss, 100 * score.accuracy, seconds)


def log_window(run: Run, progress: Progress) -> None:
    """Rank 0 writes every rank's numbers and the job's: one gather, a collective that all ranks call."""
    learner, meters = run.learner, run.meters
    meters.state_bytes = max(meters.state_bytes, state_bytes(learner.model, learner.optimizer))  # gradients held
    loss = check_finite(run.losses, run.step, run.topology.rank).mean().item()
    run.losses = []
    images, seconds = meters.throughput.lap() or (0, 0.0)
    gathered = all_gather([loss, images, seconds])
    if run.topology.rank == 0:
        tags = window_tags(gathered)
        tags["train/lr"] = learner.optimizer.param_groups[0]["lr"]
        progress.numbers(tags["train/loss_global"], tags.get("perf/images_per_s_global"))
        run.scalars.add(run.step, **tags)


def evaluate(run: Run) -> bool:
    """Exact test loss and accuracy at this step (a collective, with the training clocks stopped); True when
    ``cfg.target_accuracy`` is set and reached."""
    learner, meters, score, topology = run.learner, run.meters, run.score, run.topology
    meters.eval_time.start()
    with learner.precision.autocast():
        score.loss, score.accuracy = evaluate_as_saved(
            learner.model, *run.test_set, run.cfg.test_batch_size, topology.rank, topology.world_size
        )
    meters.eval_time.stop()
    if not math.isfinite(score.loss):  # the last step's update diverged: its training loss was still finite
        raise TrainingDiverged(f"the test loss is {score.loss} after step {run.step} (rank {topology.rank}); {ADVICE}")
    learner.model.train()  # evaluate() left it in eval mode; a mid-epoch evaluation goes on training
    target, train_s = run.cfg.target_accuracy, meters.train_time.seconds
    if target and score.accuracy >= target and score.steps_to_target is None:
        score.steps_to_target, score.time_to_target_s = run.step, train_s
        log.info("target accuracy %.2f %% reached at step %d, %.1f s of training", 100 * target, run.step, train_s)
    # time/train_s: training seconds at this evaluation, evaluation left out (bench's time to accuracy)
    run.scalars.add(run.step, **{"test/loss": score.loss, "test/accuracy": score.accuracy, "time/train_s": train_s})
    return score.steps_to_target is not None
