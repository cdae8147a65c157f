"""What a run reports at its end: results.json, model.pt and the HPARAMS entry, and the numbers in them."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from mnist_dist.metrics import all_gather, job_images_per_s
from mnist_dist.operations import checkpoint, files, machine
from mnist_dist.operations.console import summary_line
from mnist_dist.operations.errors import FILE_ONLY
from mnist_dist.parallel.state import model_state

if TYPE_CHECKING:
    from mnist_dist.train import Run

log = logging.getLogger("mnist_dist")


def finish(run: Run, wall_time_s: float) -> dict:
    """results.json, model.pt and the HPARAMS entry (rank 0); every rank leaves the process group together."""
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
        run.scalars.add(run.step, **{"results/images_per_s": results["train_images_per_s"]})
        hparams = {"mode": cfg.mode.name, "world_size": topology.world_size, "batch_size": cfg.batch_size}
        hparams.update(lr=cfg.optim.get("lr", float("nan")), seed=cfg.seed)
        run.scalars.hparams(hparams, ["test/accuracy", "test/loss", "results/images_per_s"])
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
