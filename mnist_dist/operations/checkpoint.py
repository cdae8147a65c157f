"""Checkpoints: what a resumed run needs to be the uninterrupted one. Written whole or not at all, the previous one kept
as ``checkpoint.1.pt``, never from weights that are not finite; read with ``weights_only=True``, so a file cannot run
code. Model and optimizer state go through parallel/state.py, keyed by the plain model's names in every mode."""

from __future__ import annotations

import io
import logging
import pickle
import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf

from mnist_dist.config import Config
from mnist_dist.modes import MODES, world_size
from mnist_dist.operations import files
from mnist_dist.operations.errors import ConfigError
from mnist_dist.parallel import state
from mnist_dist.step import ADVICE, TrainingDiverged, check_finite, first_non_finite

if TYPE_CHECKING:
    from mnist_dist.train import Run

NEWEST = "checkpoint.pt"
REFUSED = "resume: the checkpoint's config is not a mnist_dist config; resume another checkpoint.pt"

log = logging.getLogger("mnist_dist")


def save(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """``torch.save`` to ``path`` whole or not at all; ``keep_previous``: the file it replaces stays as
    ``<name>.1.pt``. Serialised in memory first, so a full disk fails as OSError(ENOSPC) naming ``path``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    files.write(path, buffer.getbuffer(), path.with_suffix(".1.pt") if keep_previous else None)


def locate(resume: str) -> Path:
    """The checkpoint named by ``resume=``: a checkpoint file, or a run directory holding one."""
    path = Path(resume).expanduser().resolve()
    if path.is_dir():
        path = path / NEWEST
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no checkpoint there; pass a {NEWEST} or the run directory that holds one")
    return path


def load(path: Path) -> dict:
    """The checkpoint at ``path``, or a one-line ConfigError naming it and saying why not."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False, i.e. running the file's code
        raise ConfigError(f"{path}: it holds more than tensors and plain values: not a mnist_dist checkpoint") from None
    except Exception as error:  # truncated, unreadable: the same to the user
        detail = (str(error) or "no detail").splitlines()[0]
        raise ConfigError(f"{path}: cannot read the checkpoint ({type(error).__name__}: {detail})") from None


def newest_readable(run_dir: Path) -> tuple[Path, dict] | None:
    """``resume=auto``'s checkpoint and its contents: the newest that can be read (a skipped one is logged), or None."""
    skipped = []
    for path in (run_dir / NEWEST, run_dir / "checkpoint.1.pt"):
        if not path.exists():
            continue
        try:
            saved = load(path)
        except ConfigError as why:
            skipped.append(str(why))
            continue
        if skipped:
            log.warning("resume=auto: skipped %s; resuming from %s (step %d)", "; ".join(skipped), path, saved["step"])
        return path.resolve(), saved
    if skipped:
        raise ConfigError(
            f"resume=auto: no checkpoint in {run_dir} can be read: {'; '.join(skipped)}; move them away to start afresh"
        )
    return None


def saved_config(state: dict) -> dict:
    """The checkpoint's config as plain data (``yaml.safe_load``), never through OmegaConf, whose interpolations
    and resolvers (``${oc.env:...}``) a crafted file would run: one is refused."""
    saved = yaml.safe_load(state["config"])
    if "${" in str(saved):
        raise ConfigError(REFUSED)
    return saved


def resumed_config(state: dict, cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """The checkpoint's config with the settings that ``overrides`` (Hydra's) name taken from ``cfg``: a group chosen
    (``model=fastnet``) whole, and everything for ``recipe=``, whose package is the whole config."""
    mine = asdict(cfg)
    keys = {arg.lstrip("~+").split("=", 1)[0] for arg in overrides}
    try:
        saved = saved_config(state)
        for key in mine if "recipe" in keys else [key for key in keys if key.split(".")[0] in mine]:  # not hydra.*
            *parents, last = key.split(".")
            source, target = mine, saved
            for parent in parents:
                source, target = source.get(parent, {}), target.setdefault(parent, {})
            if last in source:
                target[last] = source[last]
            else:  # ~model.dropout
                target.pop(last, None)
        name = saved["mode"]["name"]
        conf = OmegaConf.structured(Config(mode=MODES[name].schema(name=name)))
        return OmegaConf.to_object(OmegaConf.merge(conf, saved))  # typed: a wrong type or unknown key fails
    except Exception:  # no config, not YAML, not a mapping, a key missing, a value of another type
        raise ConfigError(REFUSED) from None


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses, before anything is written, a resume of a finished run or with another global batch, which would
    misplace it in its epoch. A checkpoint that does not fit the model, optimizer or amp fails as it is loaded."""
    saved = saved_config(state)
    if saved["batch_size"] != cfg.batch_size:
        raise ConfigError(
            f"resume: batch_size={cfg.batch_size}, but the checkpoint's steps are of {saved['batch_size']} images, "
            "which place it in its epoch; leave batch_size out to go on with the run's own"
        )
    if state["epoch"] >= cfg.epochs:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {cfg.epochs}; "
            f"pass epochs={state['epoch'] + 1} or more to train further"
        )
    # Another mode or world size is no change, only said: the global batches, and so the training, are the same.
    now, then = (cfg.mode.name, world_size(cfg)), (saved["mode"]["name"], state["world_size"])
    if now != then:
        log.info("resuming with mode=%s on %d ranks a checkpoint written with mode=%s on %d", *now, *then)


def save_checkpoint(run: Run, epoch: int, epoch_step: int) -> None:
    """Rank 0 saves what a resume needs after ``epoch`` epochs and ``epoch_step`` steps of the next (a collective);
    raises TrainingDiverged on a non-finite loss since the last check, or on non-finite weights (whatever the loss)."""
    learner, meters, path = run.learner, run.meters, run.run_dir / NEWEST
    check_finite(run.losses, run.step, run.topology.rank)
    # Collectives: fsdp gathers its shards; rank 0 keeps the full state.
    rng = rng_states_of_all_ranks()
    mine = {
        "train_s": meters.train_time.read(),  # mid-epoch it is running
        "eval_s": meters.eval_time.read(),
        "images": meters.throughput.total_images,
        "images_s": meters.throughput.total_seconds,
        "window_losses": [loss.item() for loss in run.losses] if epoch_step else [],  # a split log window
    }
    meters_by_rank = gather_objects(mine)
    model_state = state.model_state(learner.model)
    optimizer_state = state.optimizer_state(learner.model, learner.optimizer)
    if run.topology.rank == 0:
        if poisoned := first_non_finite(model_state):
            raise TrainingDiverged(f"the weights are not finite after step {run.step} (rank 0, {poisoned}); {ADVICE}")
        saved = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": learner.scheduler.state_dict(),
            "scaler": learner.precision.scaler.state_dict(),
            "epoch": epoch,  # epochs completed
            "epoch_step": epoch_step,  # steps done in the next (0 at an epoch's end)
            "step": run.step,
            "rng": rng,  # by rank
            "meters": meters_by_rank,
            "world_size": run.topology.world_size,
            "config": run.config_yaml,
        }
        save(saved, path, keep_previous=True)


def restore(run: Run, resumed: dict) -> None:
    """Puts the rest of a checkpoint into ``run`` (the weights went into the plain model before it was wrapped). Clocks
    go on from rank 0's; counts and a split log window from the rank's own, on the checkpoint's number of ranks only."""
    learner, meters, by_rank = run.learner, run.meters, resumed["meters"]
    state.load_optimizer_state(learner.model, learner.optimizer, resumed["optimizer"])
    learner.scheduler.load_state_dict(resumed["scheduler"])
    learner.precision.scaler.load_state_dict(resumed["scaler"])  # fp16: the loss scale it had reached
    run.step = resumed["step"]
    restore_rng(resumed["rng"], run.topology.rank)
    meters.train_time.seconds, meters.eval_time.seconds = by_rank[0]["train_s"], by_rank[0]["eval_s"]
    if len(by_rank) == run.topology.world_size:
        mine = by_rank[run.topology.rank]
        meters.throughput.total_images, meters.throughput.total_seconds = mine["images"], mine["images_s"]
        run.losses = [torch.tensor(loss, device=run.train_set[0].device) for loss in mine["window_losses"]]
    log.info("resuming %s at epoch %d, step %d", run.cfg.resume, resumed["epoch"] + 1, run.step)


def gather_objects(mine: Any) -> list:
    """Every rank's ``mine``, by rank (a collective; ``[mine]`` in one process)."""
    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def rng_states_of_all_ranks() -> list[dict]:
    """Every rank's generators by rank (a collective): Python's, torch's, every GPU's (dp's replicas draw on each)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return gather_objects({"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda})


def restore_rng(states: list[dict], rank: int) -> None:
    """This rank's generators as ``states[rank]`` left them (resumed on more ranks: the new ones keep their seed)."""
    if rank < len(states):
        random.setstate(states[rank]["python"])
        torch.set_rng_state(states[rank]["torch"])
        if states[rank]["cuda"] is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(states[rank]["cuda"][: torch.cuda.device_count()])
