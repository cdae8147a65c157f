"""mnist_dist.parallel.spawn: forkserver workers start with torch imported yet see the caller as it is; a rank
that stops responding, or a killed forkserver, is named."""

import ast
import contextlib
import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mnist_dist.launch import launch
from mnist_dist.parallel import WorkerFailed, heartbeat, spawn


def _report(rank: int, world_size: int, out: str) -> None:
    seen = {
        "preloaded": "torch._dynamo" in sys.modules,  # before this function imported anything
        "probe": os.environ.get("MNIST_DIST_PROBE"),
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


# A process like a torchrun worker: init, an optimizer (its first imports torch._dynamo), destroy; then
# the threads left. gloo's run a thread pool and a socket loop of their own.
_TEARDOWN = """
import os, sys, torch, torch.distributed as dist
from mnist_dist import parallel  # imports torch.distributed.nn.functional before the group exists
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
dist.destroy_process_group()
print(sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_destroy_process_group_leaves_no_gloo_thread_for_interpreter_shutdown(tmp_path):
    # A gloo group alive at exit aborted a torchrun worker of examples/mnist_ddp.py in CI ("terminate
    # called without an active exception"); a 2-rank script of async all-reduces did so in 17 of 80
    # torchrun runs on a loaded machine, and in none of 40 with torch.distributed.nn imported first.
    result = subprocess.run(
        [sys.executable, "-c", _TEARDOWN, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    threads = ast.literal_eval(result.stdout)
    assert threads and not [name for name in threads if "gloo" in name], threads


def test_forkserver_workers_start_with_torch_imported_and_see_the_callers_environment(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.setenv("MNIST_DIST_PROBE", "first")
    spawn(_report, 2, str(first), start_method="forkserver")
    # The server may have started above with the first environment; later workers still get the caller's.
    monkeypatch.setenv("MNIST_DIST_PROBE", "second")
    monkeypatch.chdir(second)
    spawn(_report, 2, str(second), start_method="forkserver")
    assert [r["preloaded"] for r in reports(first) + reports(second)] == [True] * 4
    assert [r["probe"] for r in reports(first)] == ["first"] * 2
    assert [r["probe"] for r in reports(second)] == ["second"] * 2
    assert [r["cwd"] for r in reports(second)] == [str(second)] * 2
    assert [r["rank"] for r in reports(second)] == ["0", "1"]


# --- issue 27: a rank that stops responding, a killed forkserver ------


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def assert_all_gone(pid_dir: Path, count: int) -> None:
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == count
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []


def _stops_responding(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    for step in range(1, 1000):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1))
        heartbeat("training", step)


@pytest.mark.slow
def test_a_rank_that_stops_responding_is_named_with_where_it_was(tmp_path):
    with pytest.raises(WorkerFailed) as error:
        spawn(_stops_responding, 2, str(tmp_path), start_method="forkserver")
    assert str(error.value).startswith(
        "rank 1 stopped responding (last seen: training after step 4; its process is stopped, e.g. by SIGSTOP); "
        "rank 0 timed out waiting for it: "
    ), str(error.value)
    assert_all_gone(tmp_path, 2)


def _aborted_by_a_watchdog(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    heartbeat("training", 4)
    if rank == 0:
        time.sleep(1)
        os.abort()  # as NCCL's watchdog ends a rank whose collective waited dist.timeout_s
    time.sleep(120)  # rank 1: stuck, still running


def test_a_rank_aborted_while_another_still_runs_names_both(tmp_path):
    # before: "rank 0 failed: killed by SIGABRT", which under NCCL names the victim of the stuck rank
    with pytest.raises(WorkerFailed) as error:
        spawn(_aborted_by_a_watchdog, 2, str(tmp_path), start_method="forkserver")
    message = str(error.value)
    assert message.startswith("rank 0 failed: killed by SIGABRT") and "NCCL's watchdog" in message, message
    assert "rank 1 is still running (last seen: training after step 4)" in message, message
    assert_all_gone(tmp_path, 2)


def _sleeps(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    time.sleep(120)


def _kill_the_forkserver_once_started(pid_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_forkserver_is_named_and_leaves_no_worker(tmp_path):
    killer = threading.Thread(target=_kill_the_forkserver_once_started, args=(tmp_path,), daemon=True)
    killer.start()
    with pytest.raises(WorkerFailed) as error:
        spawn(_sleeps, 2, str(tmp_path), start_method="forkserver")
    killer.join()
    assert str(error.value).startswith(
        "the forkserver process that starts the workers was killed by SIGKILL (the OOM killer?), and rank "
    ), str(error.value)
    assert_all_gone(tmp_path, 2)


@pytest.mark.slow
def test_a_training_rank_that_stops_responding_is_named_with_its_step(make_config, tmp_path):
    pids, run = tmp_path / "pids", tmp_path / "run"  # Hydra would have created the run directory
    pids.mkdir(), run.mkdir()
    settings = [
        "mode=ddp",
        "gpus=2",
        "device=cpu",
        "batch_size=32",
        "epochs=1",
        "dist.timeout_s=5",
        "mode.peer_wait_s=5",
    ]
    settings += ["model._target_=failing_model.FailingConvNet", "+model.stop=true", f"+model.pid_dir={pids}"]
    with pytest.raises(WorkerFailed) as error:
        launch(make_config(*settings), run)
    message = str(error.value)  # rank 1 stops itself in step 3's forward; rank 0 waits in its all-reduce
    assert message.startswith(
        "rank 1 stopped responding (last seen: training after step 2; its process is stopped, e.g. by SIGSTOP); "
        "rank 0 timed out waiting for it: "
    ), message
    assert message.endswith(f"(log: {tmp_path}/run/rank_1.log)") and "\n" not in message
    assert_all_gone(pids, 2)


# --- issue 38: a log that does not exist is never named; a job interrupted while the forkserver imports ------


def _fails_before_its_log(rank: int, world_size: int, log_dir: str) -> None:
    if rank == 0:
        raise RuntimeError("failed before its log was opened")
    Path(log_dir, f"rank_{rank}.log").write_text("rank 1 was here\n")
    time.sleep(120)  # stopped by spawn once rank 0 failed


def test_a_rank_that_failed_before_opening_its_log_names_none(tmp_path):
    # before: "rank 0 failed: RuntimeError: ... (log: .../rank_0.log)", a file that never existed
    with pytest.raises(WorkerFailed) as error:
        spawn(
            _fails_before_its_log, 2, str(tmp_path), log_path=f"{tmp_path}/rank_{{rank}}.log", start_method="forkserver"
        )
    assert str(error.value) == "rank 0 failed: RuntimeError: failed before its log was opened"


_INTERRUPTED_WHILE_IMPORTING = """
import os, signal, sys
import slow_import
from mnist_dist.parallel import spawn

def stop(signum, frame):
    raise KeyboardInterrupt  # as mnist_dist's commands answer SIGTERM

signal.signal(signal.SIGTERM, stop)
os.environ["MNIST_DIST_BLOCK_IMPORT"] = sys.argv[1]  # for the forkserver, which starts now
try:
    spawn(slow_import.idle, 2, start_method="forkserver")
except KeyboardInterrupt:
    sys.exit(143)
"""


def _alive_in_session(session: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):  # fields: state, ppid, pgrp, session
            found.append(int(stat_file.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_a_job_interrupted_while_its_forkserver_imports_leaves_no_process(tmp_path):
    # before: the forkserver went on importing (6-8 s of torch in the app), then forked a worker for nobody
    importing = tmp_path / "importing"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_WHILE_IMPORTING, str(importing)], start_new_session=True, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 300  # torch's import first, on a loaded machine: no time bound
        while not importing.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert importing.exists(), "the forkserver never got to the import: the test proves nothing"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 143
        deadline = time.monotonic() + 60  # a process of the job that is exiting gets the time to finish
        while _alive_in_session(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive_in_session(launcher.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
