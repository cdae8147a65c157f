"""The command line as users run it: spawned ranks, torchrun, srun, a stop and the command it prints, on one
uninterrupted ddp run that the interrupted ones must end as. The command's processes but torchrun's are forked
from the tests' server (helpers.command): no Python to start."""

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, command, scalars, srun

from mnist_dist import __main__ as command_line
from mnist_dist.operations import checkpoint
from mnist_dist.operations.preemption import REQUEUE

TINY = ["data.mirrors=[]", "progress=false", "epochs=1", "batch_size=32"]


def cli(run_dir: Path, *overrides: str, launcher=None, env=None) -> subprocess.CompletedProcess:
    """The command (``env`` added to its environment), or ``launcher`` starting it, in a process of its own writing to
    ``run_dir``: its exit status and output (as stderr)."""
    overrides = [*overrides, f"hydra.run.dir='{run_dir}'"]  # quoted: a path may hold braces
    if launcher:
        run = [*launcher, *overrides]
        result = subprocess.run(run, cwd=run_dir.parent, capture_output=True, text=True, timeout=HANG_S)
    else:
        output = run_dir.parent / f"{run_dir.name}.out"
        process = command(overrides, run_dir.parent, env, output)
        process.join(timeout=HANG_S)
        result = subprocess.CompletedProcess(overrides, process.exitcode, "", output.read_text())
    result.run_dir = run_dir
    return result


def assert_complete_run(run_dir: Path, mode: str, ranks: int) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["mode"], results["world_size"]) == (mode, ranks)
    for rank in range(ranks):
        assert "ddp on cpu" in (run_dir / f"rank_{rank}.log").read_text()
    # One TensorBoard run, written by rank 0, with every rank's numbers and no more.
    assert {path.parent for path in run_dir.rglob("events.out.tfevents.*")} == {run_dir / "tb"}
    ranks_logged = {tag.split("/")[0] for tag in scalars(run_dir) if tag.startswith("rank_")}
    assert ranks_logged == {f"rank_{rank}" for rank in range(ranks)}
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "model.pt").exists()
    return results


def interrupted(tiny_root) -> list[str]:
    """2 epochs of 20 steps, a checkpoint every 5, rank 1 misbehaving at step 13 of the first attempt only."""
    same = [f"data.root={tiny_root}", *TINY, "epochs=2", "checkpoint_every_steps=5", "log_every=4", "resume=auto"]
    return [*same, "model._target_=failing_model.FailingConvNet", "+model.fail_step=13", "+model.attempt=0"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_root, tmp_path_factory) -> subprocess.CompletedProcess:
    """A ddp run from the command line: the run the interrupted ones must end as; also profiled (which changes no
    number)."""
    whole = cli(
        tmp_path_factory.mktemp("whole") / "run_{rank}",  # braces in a path are a path, not a rank's
        "mode=ddp",
        "gpus=2",
        *interrupted(tiny_root),
        "+model.fail_rank=-1",
        "profile=true",
    )
    assert whole.returncode == 0, whole.stderr
    return whole


@pytest.mark.slow
def test_ddp_spawns_one_worker_per_rank(uninterrupted):
    err, run_dir = uninterrupted.stderr, uninterrupted.run_dir
    assert "[rank 1]" not in err  # rank 0 alone talks to the console
    assert_complete_run(run_dir, "ddp", 2)
    # The config is one line on the console, the whole of it in the log (and config.yaml).
    assert "\nconfig: mode=ddp gpus=2 data.root=" in err and "(all of it in config.yaml)" in err
    assert "sync_batchnorm: false" not in err and "sync_batchnorm: false" in (run_dir / "rank_0.log").read_text()


@pytest.mark.slow
def test_profile_writes_a_chrome_trace_per_rank_with_the_steps_ranges_backward_and_all_reduce(uninterrupted):
    run_dir = uninterrupted.run_dir
    for rank in range(2):
        names = {
            event.get("name", "")
            for event in json.loads((run_dir / f"trace_rank{rank}.json").read_text())["traceEvents"]
        }
        # counted from 0: warmup_steps (5) and the profiler's own warm-up step left out, then 5 steps
        assert {name for name in names if name.startswith("ProfilerStep#")} == {
            f"ProfilerStep#{i}" for i in range(6, 11)
        }
        assert "autograd::engine::evaluate_function: ConvolutionBackward0" in names, rank
        assert "gloo:all_reduce" in names, rank
        # the split of a step's time that every mode shows alike: ranges in the step's own code
        assert {"forward", "backward", "optimizer"} <= names, rank


@pytest.mark.slow
def test_restarted_and_requeued_jobs_end_as_an_uninterrupted_run(tiny_root, tmp_path, uninterrupted):
    # Two interruptions, each mid-epoch and resumed by resume=auto. Dropout is on, so every rank's random
    # state must be restored too.
    same = interrupted(tiny_root)
    # torchrun: SIGKILL; the agent restarts both workers, which go on from the checkpoint of step 10.
    torchrun = (sys.executable, "-m", "torch.distributed.run")  # the torchrun command, without its script
    launcher = [*torchrun, "--nproc_per_node=2", "--max-restarts=1", "-m", "mnist_dist"]
    restarted = cli(tmp_path / "restarted", "mode=ddp", *same, "+model.kill=true", launcher=launcher)
    assert restarted.returncode == 0, restarted.stderr
    assert "resuming" in (tmp_path / "restarted" / "rank_0.log").read_text()
    assert_complete_run(tmp_path / "restarted", "ddp", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restarted"]  # rank 1 made no directory of its own
    # srun: SIGUSR1 to rank 1 alone in step 13; both ranks stop after step 14 (its vote is read then), though
    # no step logs (log_every above the run's steps) and none checkpoints there
    requeued, srun_job = tmp_path / "requeued", ["mode=ddp", *same, "+model.usr1=true", "log_every=1000"]
    assert srun(requeued, *srun_job) == [REQUEUE, REQUEUE]
    state = checkpoint.load(requeued / "checkpoint.pt")
    assert (state["epoch"], state["epoch_step"], state["step"]) == (0, 14, 14)
    assert srun(requeued, *srun_job, restarts=1) == [0, 0]
    weights = [torch.load(run / "model.pt") for run in (uninterrupted.run_dir, tmp_path / "restarted", requeued)]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in other), "weights differ"


@pytest.mark.slow
def test_a_stop_mid_epoch_saves_there_and_the_printed_command_ends_as_the_uninterrupted_run(
    tiny_root, tmp_path, uninterrupted, monkeypatch, cli_in_process
):
    # SIGTERM to the command alone, as a scheduler sends it, from rank 0 in step 3 of the first epoch's 20
    run = tmp_path / "run"
    env = {"INTERRUPT_AT_STEP": "SIGTERM:3"}
    part = cli(run, "mode=ddp", "gpus=2", *interrupted(tiny_root), "+model.fail_rank=-1", env=env)
    assert part.returncode == 128 + signal.SIGTERM and "Traceback" not in part.stderr, part.stderr
    state = checkpoint.load(run / "checkpoint.pt")
    assert state["epoch"] == 0 and 3 <= state["epoch_step"] < 20, part.stderr  # at a step boundary, mid-epoch
    last = part.stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted; the last complete checkpoint is {run}/checkpoint.pt; go on with: ")
    command = shlex.split(last.split("go on with: ")[1])
    assert command == [sys.executable, "-m", "mnist_dist", f"resume={run}"]  # this interpreter, and:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mnist_dist", *command[3:]])
    command_line.main()  # its arguments, in this process (cli_in_process puts the signal handlers back)
    expected, weights = torch.load(uninterrupted.run_dir / "model.pt"), torch.load(run / "model.pt")
    assert list(weights) == list(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
