"""Bad input, faults and interruptions: never a hang, never lost data, always one clear line."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from mnist_dist.config import ConfigError
from mnist_dist.parallel import DistributedDataParallel
from mnist_dist.topology import resolve

TINY = ["data.mirrors=[]", "progress=false", "batch_size=32"]


def start(tmp_path, *overrides, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "mnist_dist", *overrides, f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(process, timeout=120):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, err


def test_fewer_gpus_than_asked_is_one_line(make_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as error:
        resolve(make_config("mode=ddp", "gpus=4", "device=cuda"))
    assert str(error.value) == (
        "device=cuda needs 4 CUDA device(s) for gpus=4 but 2 are visible; use gpus=2 or device=cpu"
    )


def test_an_explicit_busy_port_is_a_clear_error(tiny_root, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = finish(start(tmp_path, "mode=ddp", "gpus=2", f"data.root={tiny_root}", *TINY, f"dist.port={port}"))
    assert code == 1
    assert err == f"error: dist.port={port} is in use on 127.0.0.1; pass dist.port=0 to pick a free one\n"
    assert not (tmp_path / "run").exists()


def test_an_unwritable_output_directory_is_one_line(tiny_root, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = subprocess.run(
        [sys.executable, "-m", "mnist_dist", f"data.root={tiny_root}", *TINY, f"hydra.run.dir={tmp_path}/file/run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot write ") and result.stderr.count("\n") == 1
    assert "Not a directory" in result.stderr


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_and_is_named(tiny_root, tmp_path):
    started = time.monotonic()
    code, err = finish(
        start(
            tmp_path,
            "mode=ddp",
            "gpus=2",
            f"data.root={tiny_root}",
            *TINY,
            "model._target_=failing_model.FailingConvNet",
            "+model.kill=true",
        )
    )
    assert code == 1 and time.monotonic() - started < 30
    assert err.strip().splitlines()[-1].startswith("error: rank 1 failed: killed by SIGKILL")


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_named(tiny_root, tmp_path):
    code, err = finish(
        start(
            tmp_path,
            f"data.root={tiny_root}",
            *TINY,
            "epochs=1",
            "log_every=5",
            "model._target_=failing_model.FailingConvNet",
            "+model.fail_rank=0",
            "+model.nan=true",
        )
    )
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "error: the training loss is nan at step 3 (rank 0); lower "
        "optim.lr, check the data, or resume from the last checkpoint"
    )


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_launcher_stops_every_worker_and_keeps_the_checkpoint(
    tiny_root, tmp_path, signum, make_config
):
    pids = tmp_path / "pids"
    pids.mkdir()
    # 640 images at batch 32 = 20 steps an epoch; slow each step down so the signal lands mid-run.
    settings = [
        "mode=ddp",
        "gpus=2",
        f"data.root={tiny_root}",
        *TINY,
        "model._target_=failing_model.FailingConvNet",
        "+model.fail_rank=-1",
        "+model.step_seconds=0.05",
        f"+model.pid_dir={pids}",
    ]
    process = start(tmp_path, *settings, "epochs=50")
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists()
    process.send_signal(signum)
    stopped = time.monotonic()
    code, err = finish(process, timeout=30)
    assert time.monotonic() - stopped < 10
    assert code != 0 and "interrupted" in err.strip().splitlines()[-1]
    workers = [int(p.name) for p in pids.iterdir()]
    assert len(workers) == 2 and not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    epoch = torch.load(checkpoint, weights_only=False)["epoch"]
    resumed = subprocess.run(
        [sys.executable, "-m", "mnist_dist", *settings, f"epochs={epoch + 1}", f"resume={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(checkpoint, weights_only=False)["epoch"] == epoch + 1


@pytest.mark.slow
def test_two_launches_sharing_an_empty_data_root_both_train(tmp_path):
    from mnist_dist.synthetic import write_idx

    mirror = write_idx(tmp_path / "mirror")
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mnist_dist",
                f"data.root={tmp_path}/data",
                f"data.mirrors=[{mirror}]",
                "progress=false",
                "epochs=1",
                "batch_size=32",
                f"hydra.run.dir={tmp_path}/run{i}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for run in runs:
        assert run.wait(timeout=180) == 0, run.stderr.read()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        assert (tmp_path / "data" / "MNIST" / "raw" / name).read_bytes() == (mirror / name).read_bytes()


def soak(rank, world_size, steps):
    """Memory, file descriptors and threads of one rank after warm-up and after many more steps."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)), message_size=1000
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def usage():
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status["VmRSS"].split()[0]), len(os.listdir("/proc/self/fd")), int(status["Threads"])

    samples = []
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).sum().backward()
        optimizer.step()
        if step in (50, steps - 1):
            samples.append(usage())
    return samples


@pytest.mark.slow
def test_soak_three_ranks_leak_nothing(tmp_path):
    for (rss_early, fds_early, threads_early), (rss_late, fds_late, threads_late) in run_ranks(soak, 3, tmp_path, 400):
        assert rss_late - rss_early < 2048, "resident memory grew by more than 2 MiB"  # kB
        assert fds_late == fds_early and threads_late == threads_early
