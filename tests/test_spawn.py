"""mnist_dist.parallel.spawn: forkserver workers start with torch imported yet see the caller as it is; the
job's store is its own; a rank that stops responding, or a killed forkserver, is named."""

import ast
import contextlib
import json
import multiprocessing.forkserver
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from mnist_dist.launch import launch
from mnist_dist.parallel import WorkerFailed, heartbeat, init_process_group, spawn


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
from mnist_dist import parallel
parallel.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
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


# --- issue 27: a foreign client of the store, a rank that stops responding, a killed forkserver ------

# Where ranks that meet through env:// publish their gloo addresses in the store (torch 2.14).
ADDRESS = "default_pg/0//cpu//0/{rank}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sum_of_ranks(rank: int, world_size: int) -> float:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total.item()


def _foreign_client(port: int, seen: dict, done: threading.Event) -> None:
    """Another local user: connects as soon as the store listens, plants rank 1's address, reads rank 0's."""
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        try:
            # TCPStore backs off for seconds between its own tries, longer than a short job's store lives:
            # poll with a plain socket, then give a loaded machine time to validate the connection
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            break
        except Exception:  # not listening yet, or no longer
            time.sleep(0.01)
    else:
        return
    client.set(ADDRESS.format(rank=1), "127.0.0.1:1")
    seen["planted"] = True
    while not done.is_set() and time.monotonic() < deadline:
        try:
            if client.check([ADDRESS.format(rank=0)]):
                seen["read"] = client.get(ADDRESS.format(rank=0))
                return
        except dist.DistNetworkError:  # the job ended and closed its store before done was set
            return
        time.sleep(0.01)


def test_a_foreign_client_of_the_store_can_neither_read_nor_break_the_job(tmp_path):
    port, seen, done = _free_port(), {}, threading.Event()
    foreign = threading.Thread(target=_foreign_client, args=(port, seen, done), daemon=True)
    foreign.start()
    try:
        assert run_ranks(_sum_of_ranks, 2, tmp_path, port=port) == [1.0, 1.0]  # the job trains
    finally:
        done.set()
        foreign.join()
    assert seen.get("planted"), "the foreign client never got in: the test proves nothing"
    assert "read" not in seen, f"a foreign client read rank 0's address: {seen['read']!r}"


def _where_the_store_is(rank: int, world_size: int) -> tuple:
    path = Path(os.environ.get("MNIST_DIST_SPAWN_STORE", "/nowhere/store"))
    dist.barrier()  # every rank has met in the store: its keys are all written
    return str(path), stat.S_IMODE(path.parent.stat().st_mode) if path.parent.exists() else None


def _lister(port: int, seen: set, done: threading.Event) -> None:
    """Another local client of the port a spawned job listens on: lists every key it can, all the job long."""
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
            client.set("foreign/probe", "1")
            while not done.is_set():
                seen.update(client.list_keys())
                time.sleep(0.01)
        except Exception:  # not listening yet, or the job closed its store
            time.sleep(0.05)


def test_another_client_lists_no_key_of_the_job_and_cannot_open_its_store(tmp_path):
    """issue 38: the prefix was no secret, since any client's list_keys() listed job_<token>/...; the job
    now meets in a FileStore in a directory of mode 0700, which another local user cannot open."""
    port, seen, done = _free_port(), set(), threading.Event()
    lister = threading.Thread(target=_lister, args=(port, seen, done), daemon=True)
    lister.start()
    try:
        where = run_ranks(_where_the_store_is, 2, tmp_path, port=port)
    finally:
        done.set()
        lister.join()
    assert "foreign/probe" in seen, "the foreign client never got in: the test proves nothing"
    assert seen == {"foreign/probe"}, f"a foreign client listed the job's keys: {sorted(seen)}"
    (path, mode), _ = where
    assert mode == 0o700 and not Path(path).parent.exists()  # private while the job ran, removed after it


def _as_another_user(rank: int, world_size: int) -> dict:
    """What the user nobody can do to the job's store while it runs: list its directory, read its file; and, to
    show that acting as nobody works at all, list /."""
    path = Path(os.environ["MNIST_DIST_SPAWN_STORE"])
    dist.barrier()  # every rank has met in the store: its keys are all written
    tries = {"list": ["ls", str(path.parent)], "read": ["cat", str(path)], "list /": ["ls", "/"]}
    nobody = {"user": 65534, "group": 65534, "extra_groups": [], "capture_output": True}
    done = {what: subprocess.run(command, **nobody).returncode == 0 for what, command in tries.items()}
    dist.barrier()  # rank 1 keeps the job alive meanwhile
    return done


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user needs root")
def test_another_local_user_can_neither_list_nor_read_the_store(tmp_path):
    """issue 38, as another OS user (nobody): the store's directory is 0700, its file out of reach."""
    done = run_ranks(_as_another_user, 2, tmp_path)
    assert done[0] == {"list": False, "read": False, "list /": True}


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
    init_process_group("gloo", timeout=timedelta(seconds=5))
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
