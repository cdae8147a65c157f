"""mnist_dist.parallel.spawn: forkserver workers see the caller as it is; a stuck rank ends by the process group's
timeout, and the line names the rank and the likely cause."""

import ast
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import alive, wait_for

from mnist_dist.parallel import WorkerFailed, spawn


def _report(rank: int, world_size: int, out: str) -> None:
    seen = {
        "forked": os.getppid() != int(os.environ["MNIST_DIST_LAUNCHER"]),  # by the forkserver
        "probe": os.environ.get("MNIST_DIST_PROBE"),
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# A process like a torchrun worker: init, an optimizer (its first imports torch._dynamo), destroy; then
# the threads left. gloo's run a thread pool and a socket loop of their own.
_TEARDOWN = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
FIRST  # imports torch.distributed.nn.functional before the group exists
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
dist.destroy_process_group()
print(sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("first", ["from mnist_dist import parallel", "import mnist_ddp"], ids=["app", "example"])
def test_destroy_process_group_leaves_no_gloo_thread_for_interpreter_shutdown(tmp_path, first):
    # A gloo group alive at exit aborted a torchrun worker of examples/mnist_ddp.py in CI ("terminate
    # called without an active exception"); a 2-rank script of async all-reduces did so in 17 of 80
    # torchrun runs on a loaded machine, and in none of 40 with torch.distributed.nn imported first.
    result = subprocess.run(
        [sys.executable, "-c", _TEARDOWN.replace("FIRST", first), str(tmp_path / "store"), str(EXAMPLES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    threads = ast.literal_eval(result.stdout)
    assert threads and not [name for name in threads if "gloo" in name], threads


def test_forkserver_workers_see_the_callers_environment(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.setenv("MNIST_DIST_LAUNCHER", str(os.getpid()))
    monkeypatch.setenv("MNIST_DIST_PROBE", "first")
    spawn(_report, 2, str(first), start_method="forkserver")
    # The server may have started above with the first environment; later workers still get the caller's.
    monkeypatch.setenv("MNIST_DIST_PROBE", "second")
    monkeypatch.chdir(second)
    spawn(_report, 2, str(second), start_method="forkserver")
    assert [r["forked"] for r in reports(first) + reports(second)] == [True] * 4
    assert [r["probe"] for r in reports(first)] == ["first"] * 2
    assert [r["probe"] for r in reports(second)] == ["second"] * 2
    assert [r["cwd"] for r in reports(second)] == [str(second)] * 2
    assert [r["rank"] for r in reports(second)] == ["0", "1"]


# --- a stuck rank, a rank that fails first ------


def assert_all_gone(pid_dir: Path, count: int) -> None:
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == count
    assert wait_for(lambda: not [pid for pid in pids if alive(pid)], deadline_s=60)


def _stops_responding(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    init = os.environ["MNIST_DIST_INIT_METHOD"]  # spawn's store; timeout: dist.timeout_s
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=timedelta(seconds=2))
    for step in range(1, 1000):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1))


@pytest.mark.slow
def test_a_stuck_rank_ends_the_job_by_the_process_groups_timeout_naming_the_likely_cause(tmp_path, monkeypatch):
    # the stopped rank waits out each grace for the other ranks to end: only SIGKILL ends it
    monkeypatch.setattr(importlib.import_module("mnist_dist.parallel.spawn"), "_GRACE_S", 0.5)
    with pytest.raises(WorkerFailed, match=r"^rank 0 failed: .*[Tt]imed out.*dist.timeout_s.*join\(\)") as error:
        spawn(_stops_responding, 2, str(tmp_path), start_method="forkserver")
    assert "\n" not in str(error.value)
    assert_all_gone(tmp_path, 2)  # the stopped rank too


def _aborted_by_a_watchdog(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    if rank == 0:
        os.abort()  # as NCCL's watchdog ends a rank whose collective waited dist.timeout_s
    time.sleep(120)  # rank 1: stuck, still running


def test_a_rank_aborted_as_by_nccls_watchdog_names_the_likely_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.import_module("mnist_dist.parallel.spawn"), "_GRACE_S", 0.5)  # rank 1 sleeps on
    with pytest.raises(WorkerFailed, match=r"^rank 0 failed: killed by SIGABRT .*dist.timeout_s.*join\(\)"):
        spawn(_aborted_by_a_watchdog, 2, str(tmp_path), start_method="forkserver")
    assert_all_gone(tmp_path, 2)


def _says_no(rank: int, world_size: int) -> None:
    raise ValueError(f"rank {rank} says no")


def test_a_failed_rank_is_named_and_leaves_no_traceback_file_in_the_temp_folder(tmp_path, monkeypatch):
    # torch's start_processes hands each rank a file for its traceback and never removes it (see pytorch/pytorch#169258)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(WorkerFailed, match=r"^rank \d failed: ValueError: rank \d says no$"):
        spawn(_says_no, 2, start_method="forkserver")
    assert not list(tmp_path.glob("pytorch-errorfile-*"))


def test_a_rank_that_saw_its_peer_end_first_names_the_likely_cause_too():
    # Two ranks in mismatched collectives both wait dist.timeout_s; the one that times out first may take longer to
    # exit than its peer, which then fails on the closed connection and is the rank the launcher names.
    from mnist_dist.parallel.spawn import _reason

    closed = "Traceback:\n  File x\nRuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:59548."
    line = _reason(torch.multiprocessing.ProcessRaisedException(closed, 1, 123), None)
    assert line.startswith("rank 1 failed: RuntimeError: [pair.cc:561] Connection closed by peer"), line
    assert "another rank ended first" in line and "dist.timeout_s" in line and "join()" in line, line
