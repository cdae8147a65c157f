"""What several test modules share; tests import these from here, never from each other or from conftest."""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mnist_dist.config import validate
from mnist_dist.parallel import spawn
from mnist_dist.tools import read_scalars
from mnist_dist.topology import resolve

FASHION = Path("/usr/share/datasets/fashion-mnist")
# How long a test waits for a command before calling it hung: what a ddp run on tiny data may take on a
# 2-core machine at load 8 (starting the ranks alone can take a minute there), with room to spare.
# Tests assert outcomes; this only ends a hang.
HANG_S = 600


def compose_config(data_root: Path, *overrides: str):
    """The Config the CLI would run with these overrides, on the data in ``data_root``, no bar."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"data.root={data_root}", "data.mirrors=[]", "progress=false", *overrides])
    return OmegaConf.to_object(cfg)


def validate_here(cfg) -> None:
    """config.validate on the topology this machine gives ``cfg``, as launch checks it."""
    validate(cfg, resolve(cfg))


def events(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir / "tb"))
    accumulator.Reload()
    return accumulator


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar tag of the run's TensorBoard run (rank 0 writes every rank's), values in step order."""
    return {tag: list(values.values()) for tag, values in read_scalars(run_dir).items()}


def _entry(rank: int, world_size: int, fn, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: no oversubscription
    # a collective that a bug leaves waiting fails within minutes instead of torch's default half hour
    init = os.environ["MNIST_DIST_INIT_METHOD"]  # spawn's store
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=timedelta(seconds=180))
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(workdir, f"result_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, workdir: Path, *args) -> list:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` gloo ranks in fresh processes; returns what each
    returned, by rank."""
    spawn(_entry, world_size, fn, str(workdir), args, start_method="forkserver")  # one torch import per session
    return [torch.load(workdir / f"result_{r}.pt", weights_only=False) for r in range(world_size)]


class Raised:
    """What a call of run_batch raised on a rank, in place of its result."""

    def __init__(self, error: BaseException):
        self.text = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"Raised({self.text!r})"


def _each(rank: int, world_size: int, calls: dict) -> dict:
    results = {}
    for key, (fn, *args) in calls.items():
        try:
            results[key] = fn(rank, world_size, *args)
        except Exception as error:  # one broken check must not hide the others' results
            results[key] = Raised(error)
        dist.barrier()  # the next call starts together on every rank
    return results


def run_batch(calls: dict, world_size: int, workdir: Path) -> dict[str, list]:
    """Like run_ranks for several calls ``{key: (fn, *args)}`` in ONE job, in order: a test module pays
    for starting the ranks once, not once per test. Returns ``{key: [result by rank]}``; a call that
    raised gives ``Raised`` on that rank (the calls must raise alike on every rank, or not at all)."""
    by_rank = run_ranks(_each, world_size, workdir, calls)
    return {key: [results[key] for results in by_rank] for key in calls}


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: not gone, nor a zombie (stopped; only its exit status waits to be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def children(parent: int, command_part: str) -> list[int]:
    """The live child processes of ``parent`` whose command line contains ``command_part``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        if ppid == parent and command_part in command:
            found.append(int(stat.parent.name))
    return found


def wait_for(condition, deadline_s: float = HANG_S, every_s: float = 0.1) -> bool:
    """Polls ``condition`` until it holds or ``deadline_s`` passed; whether it holds."""
    deadline = time.monotonic() + deadline_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(every_s)
    return condition()


def default_sigint() -> None:
    """A child's Ctrl-C as from a terminal (a suite started in the background, ``pytest &``, has it ignored, and
    a process inherits that through exec): for ``preexec_fn``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _command(argv: list[str], env: dict[str, str], cwd: str, output: str | None) -> None:
    os.setsid()  # a session of its own, as a terminal's foreground job
    if output:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1), os.dup2(fd, 2)  # its ranks' too: they are its children
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["mnist_dist", *argv]
    runpy.run_module("mnist_dist", run_name="__main__", alter_sys=True)


def command(argv: list[str], cwd: Path, env: dict | None = None, output: Path | None = None):
    """``python -m mnist_dist <argv>`` in ``cwd`` (its own session), ``env`` added to this process's environment,
    its output into the file ``output`` (None: nowhere asked); started, as a multiprocessing Process. Forked from the
    tests' server, which has imported torch and the app: the command as users run it, but for starting Python."""
    args = (list(argv), {**os.environ, **(env or {})}, str(cwd), output and str(output))
    process = get_context("forkserver").Process(target=_command, args=args)
    process.start()
    return process


def srun(run_dir: Path, *overrides: str, restarts: int = 0) -> list[int]:
    """Two local processes as ``srun --ntasks=2`` starts them (SLURM's variables, no scheduler); their exit codes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv, tasks = [*overrides, f"hydra.run.dir={run_dir}"], []
    for rank in range(2):
        slurm = {"SLURM_PROCID": rank, "SLURM_LOCALID": rank, "SLURM_NTASKS": 2, "SLURM_NODELIST": "localhost"}
        slurm |= {"SLURM_JOB_ID": 4242, "SLURM_STEP_ID": 0, "SLURM_RESTART_COUNT": restarts, "MASTER_PORT": port}
        tasks.append(command(argv, run_dir.parent, {k: str(v) for k, v in slurm.items()}))
    for task in tasks:
        task.join(timeout=300)
    return [task.exitcode for task in tasks]


def threaded_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply as far as autocast goes, with the CPU standing in for CUDA: one thread per
    replica, which re-enters autocast with the caller's on/off and no dtype (the dtype is thread-local)."""
    enabled, results = torch.is_autocast_enabled("cpu"), {}

    def worker(i, module, args):
        with torch.amp.autocast("cpu", enabled=enabled):
            results[i] = module(*args)

    threads = [threading.Thread(target=worker, args=(i, m, a)) for i, (m, a) in enumerate(zip(modules, inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(modules))]


class TinyMLP(torch.nn.Sequential):
    """``model._target_=helpers.TinyMLP``: milliseconds a step, for tests of what a run does, not of convolutions."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
