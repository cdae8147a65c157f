"""The one launch path: resolve the topology, validate once, prepare the data, then train: here in a one-process
mode, one process per device through ``mnist_dist.parallel.spawn``, or, under torchrun or srun, as this rank."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext, suppress
from pathlib import Path

from mnist_dist.config import Config, validate
from mnist_dist.data import prepare
from mnist_dist.modes import MODES
from mnist_dist.operations import checkpoint, preemption, rundir
from mnist_dist.parallel.spawn import WorkerFailed, die_with_parent, spawn
from mnist_dist.topology import Topology, from_env, launcher, resolve, setup_process
from mnist_dist.train import train

__all__ = ["launch", "WorkerFailed"]

log = logging.getLogger("mnist_dist")


def launch(cfg: Config, run_dir: Path, overrides: Sequence[str] = ()) -> dict | None:
    """Runs the job; returns rank 0's results (None in spawned mode). ``overrides``: Hydra's, what a resume changes."""
    by, asked, fresh = launcher(), cfg.gpus, not cfg.resume
    # Under a launcher this process is a rank: a signal stops it at a step boundary, with a checkpoint.
    with preemption.installed(cfg.dist.timeout_s) if by else nullcontext():
        if by:
            die_with_parent()  # torchrun's agent: a worker whose agent was killed must not train on alone
            topology = from_env(cfg)
            if fresh:  # before the rendezvous: a refused rank must not wait dist.timeout_s for its peers
                validate(cfg, topology)
            setup_process(topology, cfg.deterministic, cfg.dist.timeout_s, cfg.tf32)  # rank 0 names the directory:
            run_dir = rundir.on_this_node(run_dir)  # its Hydra chose it (see __main__); each node creates it
        cfg, run_dir, saved = _resume(cfg, run_dir, overrides)
        if by:
            cfg.gpus = asked  # the launcher says how many ranks run, not the checkpoint
        else:
            topology = resolve(cfg)
        if not (by and fresh):  # once, on the config that runs (a resume's: the checkpoint's own)
            validate(cfg, topology)
        if by:
            cfg.gpus = topology.world_size  # what runs, as config.yaml records it
        if saved:
            checkpoint.check_resumable(saved, cfg)
        data_dir = prepare(cfg.data.name, cfg.data.root, cfg.data.mirrors)  # under a lock: once per machine
        if topology.rank == 0:
            log.info("config: %s (all of it in config.yaml)", " ".join(overrides) or "the defaults")
        if by:
            return train(cfg, run_dir, data_dir, topology)
        if not MODES[cfg.mode.name].per_device:
            return _worker(cfg, run_dir, data_dir, topology)
        # CPU workers fork from a server that imported torch (seconds each); a fork cannot use its parent's CUDA.
        start = "forkserver" if topology.device_type == "cpu" else "spawn"
        spawn(_spawned_worker, topology.world_size, cfg, run_dir, data_dir, log_dir=str(run_dir), start_method=start)
        return None


def _spawned_worker(rank: int, size: int, cfg: Config, run_dir: Path, data_dir: Path) -> None:
    with suppress(preemption.Stopped):  # the launcher passed on a Ctrl-C: the checkpoint is saved; it says so
        _worker(cfg, run_dir, data_dir, from_env(cfg))  # spawn set what torchrun sets


def _worker(cfg: Config, run_dir: Path, data_dir: Path, topology: Topology) -> dict:
    with preemption.installed(cfg.dist.timeout_s):
        setup_process(topology, cfg.deterministic, cfg.dist.timeout_s, cfg.tf32)
        return train(cfg, run_dir, data_dir, topology)


def _resume(cfg: Config, run_dir: Path, overrides: Sequence[str]) -> tuple[Config, Path, dict | None]:
    """The config the run goes on with, its directory and the checkpoint that ``resume=`` names (None: a fresh run)."""
    if cfg.resume == "auto":  # read once: whether it can be, and what it holds
        path, state = checkpoint.newest_readable(run_dir) or (None, None)
    elif cfg.resume:
        path = checkpoint.locate(cfg.resume)
        state = checkpoint.load(path)
    else:
        state = None
    if state is None:
        cfg.resume = ""
        rundir.refuse_another_run(run_dir)  # a fresh run: nothing of another may be replaced
        return cfg, run_dir, None
    cfg = checkpoint.resumed_config(state, cfg, overrides)
    cfg.resume = str(path)
    return cfg, path.parent, state  # the run goes on in its own directory
