"""The worker: setup → build → loop → evaluate → tear down, the same code in every mode and on every rank.

It gets a plain config and plain paths (never Hydra globals) and never touches the network: the
parent prepared the data before this process existed.
"""

from __future__ import annotations

import logging
import os
import random
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from mnist_dist import checkpoint, machine
from mnist_dist.build import build_model
from mnist_dist.config import DISTRIBUTED_MODES, Config
from mnist_dist.console import FILE_ONLY, Progress, config_line, console_filter
from mnist_dist.data import load_split, to_device_tensors
from mnist_dist.metrics import Scalars, StepTimer, Throughput, all_reduce
from mnist_dist.parallel import gradient_sync, plain_state_dict, unwrap, wrap_model
from mnist_dist.precision import Precision
from mnist_dist.sharding import epoch_order, eval_shard, rank_batches, steps_per_epoch

log = logging.getLogger("mnist_dist")


def train(
    cfg: Config, run_dir: Path, raw_dir: Path, device: str, rank: int = 0, world_size: int = 1, local_rank: int = 0
) -> dict:
    """Trains and evaluates; rank 0 writes checkpoints and results.json. Returns the results."""
    # --- setup -------------------------------------------------------------------------------
    started = time.perf_counter()
    setup_logging(run_dir, rank)
    torch_device = setup_process(cfg, device, rank, world_size, local_rank)
    resumed = checkpoint.load(Path(cfg.resume)) if cfg.resume else None
    # On resume, drop any scalars the interrupted run wrote after its checkpoint: no duplicate steps.
    scalars = Scalars(run_dir, rank, purge_step=resumed["step"] + 1 if resumed else None)
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if rank == 0:  # the console gets one line, the log file and config.yaml all of it
        log.info("config: %s (all of it in config.yaml)", config_line(cfg))
        log.info("config:\n%s", config_yaml, extra=FILE_ONLY)
        (run_dir / "config.yaml").write_text(config_yaml)
    try:
        # --- build ---------------------------------------------------------------------------
        train_x, train_y = to_device_tensors(
            *load_split(raw_dir, train=True), cfg.data.mean, cfg.data.std, torch_device
        )
        test_x, test_y = to_device_tensors(*load_split(raw_dir, train=False), cfg.data.mean, cfg.data.std, torch_device)
        if cfg.channels_last:  # NHWC: what tensor-core convolutions read without a transpose
            train_x, test_x = (t.contiguous(memory_format=torch.channels_last) for t in (train_x, test_x))
        torch.manual_seed(cfg.seed)  # same initial weights in every mode and on every rank
        model = build_model(cfg.model)  # a bad model._target_ is one line saying what to do
        if resumed:
            model.load_state_dict(resumed["model"])  # into the plain model, before any wrapper
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if cfg.compile:
            model.compile()  # in place: parameter names, hooks and checkpoints stay as they are
        model = wrap_model(model, cfg.mode, torch_device, cfg.gpus)
        random.seed(cfg.seed + rank)
        torch.manual_seed(cfg.seed + rank)  # each rank its own dropout masks, repeatably
        optimizer = getattr(torch.optim, cfg.optim.name)(model.parameters(), lr=cfg.optim.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.optim.gamma)
        precision = Precision(cfg.amp, torch_device)
        first_epoch, step = 1, 0
        if resumed:
            optimizer.load_state_dict(resumed["optimizer"])
            scheduler.load_state_dict(resumed["scheduler"])
            precision.scaler.load_state_dict(resumed["scaler"])  # fp16: the loss scale it had reached
            first_epoch, step = resumed["epoch"] + 1, resumed["step"]
            checkpoint.restore_rng(resumed["rng"], rank)
            log.info("resuming %s at epoch %d, step %d", cfg.resume, first_epoch, step)
        finish_sync = gradient_sync(model)
        throughput = Throughput(torch_device, cfg.warmup_steps)
        timer = StepTimer(torch_device)
        steps = steps_per_epoch(len(train_x), cfg.batch_size)
        local_batch = cfg.batch_size // world_size
        log.info(
            "%s on %s: %d rank(s), global batch %d (%d per rank), %d steps per epoch",
            cfg.mode.name,
            device,
            world_size,
            cfg.batch_size,
            local_batch,
            steps,
        )

        # --- loop ----------------------------------------------------------------------------
        progress = Progress(steps * cfg.epochs, rank == 0 and cfg.progress, log, initial=step)
        for epoch in range(first_epoch, cfg.epochs + 1):
            epoch_started = time.perf_counter()
            model.train()
            order = epoch_order(len(train_x), cfg.seed, epoch).to(torch_device)
            window_losses = []  # kept on the device: no sync per step
            progress.set_epoch(epoch, cfg.epochs)
            for indices in rank_batches(order, cfg.batch_size, rank, world_size):
                step += 1
                timer.start(sample=step % cfg.log_every == 0)  # the last step of each window is timed
                x, y = train_x[indices], train_y[indices]
                timer.mark("data")
                loss = train_step(model, optimizer, finish_sync, x, y, precision, timer.mark)
                window_losses.append(loss.detach())
                throughput.step(len(indices))
                if step % cfg.log_every == 0:
                    loss_value = check_finite(torch.stack(window_losses), step, rank).mean().item()
                    log_window(
                        scalars, throughput, timer, step, rank, loss_value, optimizer.param_groups[0]["lr"], progress
                    )
                    window_losses = []
                progress.step()
            if window_losses:  # the epoch's last steps, short of a full window
                check_finite(torch.stack(window_losses), step, rank)
            throughput.pause()

            # --- evaluate --------------------------------------------------------------------
            with precision.autocast():
                test_loss, test_accuracy = evaluate(
                    unwrap(model), test_x, test_y, cfg.test_batch_size, rank, world_size
                )
            scheduler.step()
            epoch_seconds = time.perf_counter() - epoch_started
            rng = checkpoint.rng_states_of_all_ranks()  # a collective: every rank takes part
            if rank == 0:
                scalars.add(
                    step, **{"test/loss": test_loss, "test/accuracy": test_accuracy, "perf/epoch_time_s": epoch_seconds}
                )
                checkpoint.save(
                    {
                        "model": plain_state_dict(model),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": precision.scaler.state_dict(),
                        "epoch": epoch,
                        "step": step,
                        "rng": rng,
                        "world_size": world_size,
                        "config": config_yaml,
                    },
                    run_dir / "checkpoint.pt",
                )
            log.info(
                "epoch %d: test loss %.4f, accuracy %.2f %%, %.1f s",
                epoch,
                test_loss,
                100 * test_accuracy,
                epoch_seconds,
            )

        # --- tear down -----------------------------------------------------------------------
        progress.close()
        images, seconds = all_reduce([throughput.total_images, throughput.total_seconds])
        results = {
            "mode": cfg.mode.name,
            "world_size": world_size,
            "device": device,
            "epochs": cfg.epochs,
            "batch_size": cfg.batch_size,
            "test_accuracy": test_accuracy,
            "test_loss": test_loss,
            # All ranks step together, so the sum of their images over the mean time is the global rate.
            "train_images_per_s": images / (seconds / world_size) if seconds else 0.0,
            "wall_time_s": time.perf_counter() - started,
            "step_time_ms": timer.means_ms(),  # rank 0's, from the sampled steps
            "peak_rss_mib": per_rank(peak_rss_mib(), rank, world_size),
            "cuda_max_allocated_mib": per_rank(torch.cuda.max_memory_allocated() / 2**20, rank, world_size)
            if torch_device.type == "cuda"
            else None,
            "machine": machine.describe(),  # this rank's view: its torch threads, after the CPU was shared
        }
        if rank == 0:
            checkpoint.save(plain_state_dict(model), run_dir / "model.pt")
            checkpoint.save_json(results, run_dir / "results.json")
            scalars.add(step, **{"results/images_per_s": results["train_images_per_s"]})
            scalars.hparams(
                {
                    "mode": cfg.mode.name,
                    "world_size": world_size,
                    "batch_size": cfg.batch_size,
                    "lr": cfg.optim.lr,
                    "seed": cfg.seed,
                },
                ["test/accuracy", "test/loss", "results/images_per_s"],
            )
            log.info("results: %s", results)
        if dist.is_initialized():
            dist.barrier()  # leave together: a peer that disconnects while rank 0 still saves can abort it
            dist.destroy_process_group()
        return results
    except Exception:
        # The process group is left as it is: closing it now would make the other ranks fail
        # before this one has reported, and the launcher names the rank that failed first.
        log.exception("rank %d failed", rank, extra=FILE_ONLY)  # the console gets the one-line error
        raise
    finally:
        scalars.close()


class TrainingDiverged(RuntimeError):
    """The loss became nan or inf; the message names the step."""


def check_finite(losses: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """``losses`` of the steps up to ``step``, or TrainingDiverged naming the first non-finite one."""
    bad = (~torch.isfinite(losses)).nonzero()
    if len(bad):
        first = bad[0].item()
        raise TrainingDiverged(
            f"the training loss is {losses[first].item()} at step "
            f"{step - len(losses) + 1 + first} (rank {rank}); lower optim.lr, check the "
            "data, or resume from the last checkpoint"
        )
    return losses


def train_step(model, optimizer, finish_sync, x, y, precision: Precision, mark) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch; returns its loss.

    ``mark(phase)`` ends a phase for the step timer; ``finish_sync`` waits for the gradients'
    all-reduce (our DDP; a no-op elsewhere), so its phase is the communication backward did not hide.
    """
    optimizer.zero_grad(set_to_none=True)
    with precision.autocast():
        logits = model(x)
        loss = F.cross_entropy(logits, y.to(logits.device))  # split mode ends on another device
    precision.scaler.scale(loss).backward()
    mark("forward_backward")
    finish_sync()
    mark("comm_wait")
    precision.scaler.step(optimizer)
    precision.scaler.update()
    mark("optimizer")
    return loss


@torch.no_grad()
def evaluate(model, x, y, batch_size: int, rank: int, world_size: int) -> tuple[float, float]:
    """Exact loss and accuracy over the whole test set: each rank scores a disjoint share."""
    model.eval()
    share = eval_shard(len(x), rank, world_size)
    loss_sum, correct = 0.0, 0
    for start in range(share.start, share.stop, batch_size):
        stop = min(start + batch_size, share.stop)
        logits = model(x[start:stop])
        labels = y[start:stop].to(logits.device)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
    loss_sum, correct = all_reduce([loss_sum, correct])
    return loss_sum / len(x), correct / len(x)


def log_window(
    scalars: Scalars,
    throughput: Throughput,
    timer: StepTimer,
    step: int,
    rank: int,
    loss: float,
    lr: float,
    progress: Progress,
) -> None:
    """Per-rank scalars on every rank; rank 0 adds the cross-rank numbers (a collective: all ranks call)."""
    window = throughput.lap()
    images, seconds = window or (0, 0.0)
    tags = {"train/loss": loss, **{f"time/{phase}_ms": ms for phase, ms in timer.lap().items()}}
    if window:
        tags["perf/images_per_s"] = images / seconds
    global_loss, global_images = all_reduce([loss, images])
    (slowest,) = all_reduce([seconds], op=dist.ReduceOp.MAX)  # the global rate is set by the slowest rank
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        tags.update({"train/loss_global": global_loss / world_size, "train/lr": lr})
        if slowest:
            tags["perf/images_per_s_global"] = global_images / slowest
        progress.numbers(global_loss / world_size, tags.get("perf/images_per_s_global"))
    scalars.add(step, **tags)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def per_rank(value: float, rank: int, world_size: int) -> list[float]:
    """Every rank's ``value``, by rank (a collective: all ranks call)."""
    slots = [0.0] * world_size
    slots[rank] = value
    return all_reduce(slots)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to ``rank_<r>.log`` in the run directory; rank 0 also to the console."""
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    handlers = [logging.FileHandler(run_dir / f"rank_{rank}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler())
        handlers[-1].addFilter(console_filter)
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)


def setup_process(cfg: Config, device: str, rank: int, world_size: int, local_rank: int) -> torch.device:
    """This process's device, its process group (ddp modes), and deterministic kernels if asked."""
    if cfg.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op with no deterministic kernel warns (naming itself) instead of stopping the run.
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = not cfg.deterministic
    torch_device = torch.device(f"cuda:{local_rank}" if device == "cuda" else "cpu")
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    if cfg.mode.name in DISTRIBUTED_MODES and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=cfg.dist.timeout_s),
        )
    return torch_device
