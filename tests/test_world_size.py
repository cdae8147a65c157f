"""Any world size, exactly: the global batch fixes the training, so a job gives the same curve on 1 to 4 ranks,
and a checkpoint written on 2 ranks resumes on 1, 3 or 4 at the exact global sample where it stopped."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import compose_config, scalars

from mnist_dist.launch import _resume, launch
from mnist_dist.operations import checkpoint, compatibility
from mnist_dist.tools import write_idx

# 48 images per step divide among 1, 2, 3 and 4 ranks; SGD and no dropout: nothing depends on the ranks.
JOB = ("epochs=2", "batch_size=48", "optim=sgd", "model.dropout=false", "log_every=1")
MID_EPOCH = ("checkpoint_every_steps=5", "keep_checkpoints=7")  # 13 steps per epoch: saved at 5, 10, 13, ...


def train(tiny_root, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(compose_config(tiny_root, *JOB, *overrides), run_dir)
    return torch.load(run_dir / "model.pt")


def assert_close_weights(found: dict, expected: dict) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=0, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def two_ranks(tiny_root, tmp_path_factory):
    """Uninterrupted 2-rank runs (ddp and fsdp), every checkpoint kept."""
    out = tmp_path_factory.mktemp("two_ranks")
    for mode in ("ddp", "fsdp"):
        train(tiny_root, out / mode, f"mode={mode}", "gpus=2", *MID_EPOCH)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode,ranks", [("ddp", 1), ("ddp", 3), ("ddp", 4), ("fsdp", 3)])
def test_a_mid_epoch_checkpoint_resumes_on_another_number_of_ranks(tiny_root, two_ranks, tmp_path, mode, ranks):
    saved = two_ranks / mode / "checkpoint.5.pt"
    state = checkpoint.load(saved)
    assert (state["world_size"], state["epoch"], state["epoch_step"], state["step"]) == (2, 0, 10, 10)
    (tmp_path / "run").mkdir()
    shutil.copyfile(saved, tmp_path / "run" / "checkpoint.pt")
    resumed = train(tiny_root, tmp_path / "run", f"mode={mode}", f"gpus={ranks}", "resume=auto")
    assert_close_weights(resumed, torch.load(two_ranks / mode / "model.pt"))
    whole, part = scalars(two_ranks / mode)["train/loss_global"], scalars(tmp_path / "run")["train/loss_global"]
    torch.testing.assert_close(torch.tensor(part), torch.tensor(whole[10:]), rtol=0, atol=1e-5)  # steps 11 to 26


@pytest.mark.slow
def test_a_world_size_change_is_said_in_one_line_and_other_changes_still_refused(tiny_root, two_ranks, caplog):
    mnist_dist_log = logging.getLogger("mnist_dist")
    mnist_dist_log.propagate, before = True, mnist_dist_log.propagate
    try:
        with caplog.at_level(logging.INFO, logger="mnist_dist"):
            compatibility.check_resumable(*_resumed(tiny_root, two_ranks, "epochs=3", "gpus=3"))
    finally:
        mnist_dist_log.propagate = before
    assert "resuming on 3 ranks a checkpoint written on 2: the same global batches follow, split 3 ways" in caplog.text
    with pytest.raises(checkpoint.ConfigError, match=r"batch_size 48 -> 24"):
        compatibility.check_resumable(*_resumed(tiny_root, two_ranks, "epochs=3", "batch_size=24"))


def _resumed(tiny_root, two_ranks, *overrides) -> tuple:
    cfg, _, saved = _resume(compose_config(tiny_root, *JOB, f"resume={two_ranks / 'ddp'}", *overrides), two_ranks, ())
    return saved, cfg


@pytest.mark.slow
def test_the_same_job_gives_the_same_curve_on_1_to_4_ranks(tmp_path):
    """The largest difference from single's curve."""
    # 13 runs: 312 images (6 global batches, 24 dropped) keep two epochs, each in its own order, short
    root = tmp_path / "data"
    write_idx(root / "MNIST" / "raw", n_train=312, n_test=50)
    reference = torch.tensor(scalars(_run_curve(root, tmp_path / "single", "mode=single"))["train/loss_global"])
    assert len(reference) == 12
    worst = {}
    for mode in ("ddp", "torch_ddp", "fsdp"):
        for ranks in (1, 2, 3, 4):
            curve = scalars(_run_curve(root, tmp_path / f"{mode}{ranks}", f"mode={mode}", f"gpus={ranks}"))
            worst[mode, ranks] = (torch.tensor(curve["train/loss_global"]) - reference).abs().max().item()
    print("\n| mode | 1 rank | 2 ranks | 3 ranks | 4 ranks |\n|---|---|---|---|---|")
    for mode in ("ddp", "torch_ddp", "fsdp"):
        print(f"| {mode} | " + " | ".join(f"{worst[mode, n]:.1e}" for n in (1, 2, 3, 4)) + " |")
    assert max(worst.values()) <= 1e-5, worst


def _run_curve(data_root, run_dir, *overrides):
    run_dir.mkdir()
    launch(compose_config(data_root, *JOB, *overrides), run_dir)
    return run_dir


ELASTIC = (
    *("mode=ddp", "device=cpu", "epochs=1", "batch_size=32", "optim=sgd", "model.dropout=false", "log_every=1"),
    *("model._target_=failing_model.FailingConvNet", "+model.fail_rank=-1", "checkpoint_every_steps=5"),
    *("resume=auto", "progress=false", "data.mirrors=[]"),
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_torchrun_elastic_goes_on_with_the_node_that_is_left(tiny_root, tmp_path):
    """Two torchrun agents (one node each) on c10d; one is lost at step 13. The other restarts its worker on a
    world of one, which resumes the step-10 checkpoint and ends as the uninterrupted 2-rank run."""
    (tmp_path / "whole").mkdir()
    launch(compose_config(tiny_root, *ELASTIC, "gpus=2"), tmp_path / "whole")
    port, run_dir = _free_port(), tmp_path / "elastic"
    # The rendezvous store lives in this process, so that losing either agent leaves it (an agent finds
    # the port taken and joins as a client). Both agents start at once: they join the first round together.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=2"]
    agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic"]
    # A node is lost after 5 s without a heartbeat (torch's default: 15 s, idle time in this test).
    agent += ["--rdzv-conf=last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=5"]
    agent += ["-m", "mnist_dist", *ELASTIC, f"data.root={tiny_root}"]
    agent += [f"hydra.run.dir={run_dir}"]
    left = subprocess.Popen(agent, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    lost = subprocess.Popen(
        agent, cwd=tmp_path, stderr=subprocess.PIPE, text=True, env={**os.environ, "KILL_AGENT_AT_STEP": "13"}
    )
    try:
        _, errors = left.communicate(timeout=600)
        assert left.returncode == 0, errors
        assert lost.wait(timeout=120) == -signal.SIGKILL
    finally:
        for process in (left, lost):
            process.kill()
        del store
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["world_size"], results["steps"]) == (1, 20)
    assert "resuming on 1 ranks a checkpoint written on 2" in errors
    assert "\ngpus: 1\n" in (run_dir / "config.yaml").read_text()  # what ran, not the checkpoint's gpus=2
    assert_close_weights(torch.load(run_dir / "model.pt"), torch.load(tmp_path / "whole" / "model.pt"))
