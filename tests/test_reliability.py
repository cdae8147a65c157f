"""Bad input, faults and interruptions: never a hang, never lost data, always one clear line."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, alive, children, command, default_sigint, run_batch, wait_for

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import rundir
from mnist_dist.topology import resolve

TINY = ["data.mirrors=[]", "progress=false", "batch_size=32"]  # 640 images at batch 32: 20 steps an epoch
FAILING = "model._target_=failing_model.FailingConvNet"  # misbehaves on rank 1 at step 3, as told
RESUME = f"{sys.executable} -m mnist_dist resume="  # what an interrupted run prints to go on with, before its directory


def start(tmp_path, *overrides, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "mnist_dist", *overrides, f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_fewer_gpus_than_asked_is_one_line(make_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"needs 4 CUDA device.*use gpus=2"):
        resolve(make_config("mode=ddp", "gpus=4", "device=cuda"))


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_and_is_named(tiny_root, tmp_path, cli_in_process, capfd):
    pids = tmp_path / "pids"
    pids.mkdir()
    settings = [f"data.root={tiny_root}", *TINY, FAILING, "+model.kill=true", f"+model.pid_dir={pids}"]
    # dist.timeout_s longer than HANG_S: only the launcher can end the job in time
    last = cli_in_process("mode=ddp", "gpus=2", *settings, "dist.timeout_s=3600", f"hydra.run.dir={tmp_path}/run")
    # One line on the console: no traceback, nor an error of rank 0 losing its peer.
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR" not in err, err
    assert last.startswith("error: rank 1 failed: killed by SIGKILL") and last.endswith(
        f"(log: {tmp_path}/run/rank_1.log)"
    )
    assert (tmp_path / "run" / "rank_1.log").is_file()  # the failed run keeps the log its line names
    _workers_gone(pids)


def test_nan_loss_stops_with_the_step_named(tiny_root, tmp_path, cli_in_process):
    failing = [FAILING, "+model.fail_rank=0", "+model.nan=true"]
    code = cli_in_process(
        f"data.root={tiny_root}", *TINY, "epochs=1", "log_every=5", *failing, f"hydra.run.dir={tmp_path}/run"
    )
    assert code.startswith("error: the training loss is nan at step 3 (rank 0)") and "\n" not in code


def _workers_gone(pids: Path) -> None:
    workers = [int(p.name) for p in pids.iterdir()]
    assert wait_for(lambda: not [pid for pid in workers if alive(pid)]), "a worker outlived the launcher"


# Moment 0: as soon as both workers exist, before the first checkpoint (20 steps of at least 0.05 s
# away). Each further one is a random moment of the first 15 s: by hand, MNIST_DIST_INTERRUPTS=20.
INTERRUPTS = int(os.environ.get("MNIST_DIST_INTERRUPTS", "1"))
NOTHING_SAVED = (
    "interrupted before anything started; nothing was saved",  # torch and Hydra still loading
    "interrupted before the first checkpoint; nothing was saved",
)


@pytest.mark.slow
@pytest.mark.parametrize("moment", range(INTERRUPTS))
def test_ctrl_c_at_any_moment_of_a_ddp_run_is_one_true_line(tiny_root, tmp_path, moment):
    """Ctrl-C as a terminal sends it: to the launcher, the forkserver and every worker at once."""
    pids = tmp_path / "pids"
    pids.mkdir()
    # slow steps, so that the signal lands mid-run
    slow = [FAILING, "+model.fail_rank=-1", "+model.step_seconds=0.05", f"+model.pid_dir={pids}", "epochs=50"]
    ddp = ["mode=ddp", "gpus=2", f"data.root={tiny_root}", *TINY]
    # A session of its own, as a terminal's foreground job, with SIGINT not ignored (helpers.default_sigint)
    process = start(tmp_path, *ddp, *slow, preexec_fn=default_sigint, start_new_session=True)
    if moment:
        time.sleep(random.Random(moment).uniform(0.3, 15.0))
    else:
        assert wait_for(lambda: len(list(pids.iterdir())) == 2, every_s=0.02)
    os.killpg(process.pid, signal.SIGINT)
    err, code = process.communicate(timeout=HANG_S)[1], process.returncode
    assert code == 130 and "Traceback" not in err, err  # 128 + SIGINT: an interrupt, not a failure
    run, saved = tmp_path / "run", tmp_path / "run" / "checkpoint.pt"
    last = err.strip().splitlines()[-1]
    assert moment or not saved.exists()  # moment 0 is before the first checkpoint: the "nothing saved" case
    if saved.exists():  # the checkpoint that resume would go on from, and only if there is one
        assert last == f"interrupted; the last complete checkpoint is {saved}; go on with: {RESUME}{run}"
    else:
        assert last in NOTHING_SAVED and not run.exists()  # and nothing of the run is left
    _workers_gone(pids)


def _listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on, from /proc (no psutil here)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.append(fields[1])
    return addresses


def _listeners_of_job(rank, world_size, launcher):
    """The addresses that the job's processes (the launcher, the server its ranks fork from, the ranks) listen
    on, by rank 0."""
    pids = [None] * world_size
    torch.distributed.all_gather_object(pids, os.getpid())  # a collective: gloo's connections are made
    return _listening_addresses([launcher, os.getppid(), *pids]) if rank == 0 else []


def _is_loopback(address: str) -> bool:
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host == "0" * 31 + "1" or host.startswith("0000000000000000FFFF0000") and host.endswith("7F")


def _run_dirs_on_two_nodes(rank, world_size, nodes):
    """Rank r as node r's one rank, in that node's working directory: the run directories it trains in."""
    os.chdir(Path(nodes, f"node{rank}"))
    default = Path.cwd() / "outputs" / "day" / f"time_{rank}"  # each node's Hydra would name its own
    return [rundir.on_this_node(default), rundir.on_this_node(Path(nodes, f"elsewhere_{rank}"))]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One spawned job of 2 ranks for the checks below."""
    nodes = tmp_path_factory.mktemp("nodes")
    for node in ("node0", "node1"):
        (nodes / node).mkdir()
    calls = {"listeners": (_listeners_of_job, os.getpid()), "run_dirs": (_run_dirs_on_two_nodes, str(nodes))}
    return nodes, run_batch(calls, 2, nodes)


def test_a_spawned_job_listens_on_loopback_only(job):
    addresses = job[1]["listeners"][0]
    assert addresses, "found no listening socket at all: the check would prove nothing"
    assert [a for a in addresses if not _is_loopback(a)] == []


def test_two_nodes_without_a_shared_disk_each_create_rank_0s_run_directory(job):
    # Under torchrun each node creates rank 0's directory at its path, not the one its own Hydra would name.
    nodes, run_dirs = job[0], job[1]["run_dirs"]
    assert run_dirs == [[nodes / "node0/outputs/day/time_0", nodes / "elsewhere_0"]] * 2
    assert all(path.is_dir() for pair in run_dirs for path in pair)


@pytest.mark.slow
def test_a_live_runs_directory_is_refused_and_its_workers_die_with_a_killed_launcher(
    tiny_root, tmp_path, cli_in_process
):
    pids = tmp_path / "pids"
    pids.mkdir()
    # 1,000 steps of 0.5 s: an orphan would train for more than HANG_S
    slow = [FAILING, "+model.fail_rank=-1", "+model.step_seconds=0.5", f"+model.pid_dir={pids}", "epochs=50"]
    run = [f"data.root={tiny_root}", *TINY, f"hydra.run.dir={tmp_path}/run"]
    process = command(["mode=ddp", "gpus=2", *run, *slow], tmp_path, output=tmp_path / "run.out")
    try:
        assert wait_for(lambda: len(list(pids.iterdir())) == 2)
        code = cli_in_process(*run, "epochs=1")
        assert code.startswith(f"error: {tmp_path}/run is in use by another run that is still alive; wait for it")
        assert process.is_alive() and not (tmp_path / "run" / "results.json").exists()
        workers = [int(p.name) for p in pids.iterdir()]
        servers = children(process.pid, "forkserver")  # CPU workers fork from a server the launcher started
        assert len(servers) == 1
    finally:
        process.kill()
        process.join()
    assert wait_for(lambda: not [pid for pid in workers + servers if alive(pid)])


def test_an_unexpected_error_is_one_line_with_the_log(tiny_root, tmp_path, cli_in_process, capfd):
    failing = [FAILING, "+model.fail_rank=0"]
    code = cli_in_process(f"data.root={tiny_root}", *TINY, *failing, f"hydra.run.dir={tmp_path}/run")
    assert code.startswith("error: RuntimeError: injected failure") and code.endswith(f"{tmp_path}/run/rank_0.log)")
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error executing job" not in err
    assert "Traceback" in (tmp_path / "run" / "rank_0.log").read_text()  # the failed run keeps the log it names


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs: room for logs and config, not for a checkpoint (about 14 MB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file(tiny_root, tmp_path, small_disk, cli_in_process, capfd):
    run, job = small_disk / "run", [f"data.root={tiny_root}", *TINY, "epochs=1", "checkpoint_every_steps=1"]
    code = cli_in_process("mode=ddp", "gpus=2", *job, f"hydra.run.dir={run}")  # the first checkpoint: after step 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "enforce fail" not in err, err
    assert "No space left on device" in code and f"{run}/checkpoint.pt" in code and "\n" not in code
    assert not list(run.glob("*checkpoint*")) and (run / "rank_0.log").is_file()  # no half-written file; the logs
    shutil.rmtree(run)
    code = cli_in_process(*job, f"hydra.run.dir={run}")
    assert "No space left on device" in code and f"{run}/checkpoint.pt" in code and "\n" not in code
    assert not list(run.glob("*checkpoint*")) and (run / "rank_0.log").is_file()  # a failed run keeps its logs


def test_a_batch_larger_than_the_training_set_is_refused(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"batch_size=60064 must be from 1 to 60000"):
        launch(make_config("batch_size=60064", "epochs=1"), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_torchrun_worker_dies_with_its_agent(tiny_root, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "mnist_dist", "mode=ddp"]
        + [f"data.root={tiny_root}", *TINY, "epochs=50", "device=cpu", f"hydra.run.dir={tmp_path}/run"]
        # 1,000 steps of 0.5 s: an orphan would train for longer than HANG_S
        + ["model._target_=failing_model.FailingConvNet", "+model.fail_rank=-1", "+model.step_seconds=0.5"]
        + [f"+model.pid_dir={pids}"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:  # one worker: each has its own parent-death signal
        assert wait_for(lambda: len(list(pids.iterdir())) == 1)
        agent.kill()
        agent.wait()
        _workers_gone(pids)
    finally:
        agent.kill()
        agent.wait()
